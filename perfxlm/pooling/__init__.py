"""The pooling runner (vLLM's `runner="pooling"`): whole sequences through the model in one flattened batch
with no KV cache, their hidden states pooled into embeddings, class probabilities or scores.

- `model_config.py`: how a model pools (CLS, MEAN, LAST, ALL; normalize; Matryoshka dimensions; which
  tasks it serves), from the model class and its sentence-transformers files;
- `pooler.py`: the pooling types and the task heads (normalize, truncate, activation);
- `runner.py`: one batch of token sequences -> pooled states (the model's attention bound to the cacheless
  backend);
- `engine.py`: tokenizing and checking requests, batching them by total tokens, the outputs;
- `scoring.py`: score pairs (bi-encoder cosine, cross-encoder logits);
- `runner_kind.py`: which runner serves a model (vLLM's runner / convert / task);
- `llm_api.py`: `LLM.embed / classify / score / encode / reward`;
- `batcher.py`: the server's one thread that runs concurrent requests together.
"""
