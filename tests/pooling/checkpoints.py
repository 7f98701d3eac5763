"""Random-weight encoder checkpoints saved the way sentence-transformers saves real ones (bge / e5 /
all-MiniLM-shaped bi-encoders, bge-reranker-shaped cross-encoders), with a small WordPiece tokenizer."""

from __future__ import annotations

import os
import string

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "query", "passage", "what", "is", "paris", "capital",
         "of", "france", "berlin", "germany", "red", "blue", "green", "yes", "no"]


def _vocab(specials: list[str]) -> list[str]:
    letters = list(string.ascii_lowercase + string.digits)
    # each token once ("a" is a word and a letter), so the ids run 0..len-1 and len is the vocabulary size
    return list(dict.fromkeys(specials + WORDS + letters + ["##" + c for c in letters] + list(".,?!")))


def save_tokenizer(path: str, family: str) -> int:
    """A WordPiece tokenizer: BERT's specials and [CLS] a [SEP] b [SEP] pairs with segment ids,
    XLM-RoBERTa's (<s>=0, <pad>=1, </s>=2) and <s> a </s></s> b </s>, or a decoder's ("decoder": a pair is
    the two texts' tokens one after the other, as Qwen's tokenizer joins them). Returns the vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family in ("bert", "modernbert"):
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        cls, sep, pad, unk, mask = "[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        cls, sep, pad, unk, mask = "<s>", "</s>", "<pad>", "<unk>", "<mask>"
    vocab = {t: i for i, t in enumerate(_vocab(specials))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if family == "decoder":
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:0", special_tokens=[])
    elif family in ("bert", "modernbert"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    else:
        tok.post_processor = processors.RobertaProcessing((sep, vocab[sep]), (cls, vocab[cls]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, mask_token=mask,
        model_max_length=512,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"] if family == "bert"
        else ["input_ids", "attention_mask"],
    )
    fast.save_pretrained(path)
    return len(vocab)


def make_encoder(path: str, family: str = "bert", *, classifier: bool = False, num_labels: int = 1, seed: int = 0,
                 hidden_size: int = 36, layers: int = 2, heads: int = 3, intermediate: int = 52,
                 max_positions: int = 64, **config) -> str:
    """A random encoder (BertModel / XLMRobertaModel / ModernBertModel, or the *ForSequenceClassification
    head) saved with save_pretrained, its tokenizer beside it."""
    import transformers as tf

    os.makedirs(path, exist_ok=True)
    vocab_size = save_tokenizer(path, family)
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=intermediate, max_position_embeddings=max_positions, initializer_range=0.2)
    if family == "xlmr":
        kwargs.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                      max_position_embeddings=max_positions + 2)
    if family == "modernbert":  # a window of 4 on either side on the local layers: shorter than the texts
        kwargs.update(pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                      local_attention=8, global_attn_every_n_layers=2)
    kwargs.update(config)
    if classifier:
        kwargs["num_labels"] = num_labels
    names = {"bert": "Bert", "xlmr": "XLMRoberta", "modernbert": "ModernBert"}[family]
    cfg = getattr(tf, f"{names}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(tf, f"{names}ForSequenceClassification" if classifier else f"{names}Model")(cfg)
    model.eval().save_pretrained(path)
    return path


def make_sentence_transformer(path: str, family: str = "bert", pooling: str = "cls", normalize: bool = True,
                              max_seq_length: int | None = None, dense: list[dict] | None = None, **kwargs) -> str:
    """An encoder wrapped as sentence-transformers saves it: modules.json, 1_Pooling/config.json, Dense
    modules after pooling (`dense`: Dense's keyword arguments but in_features, seeded) and a Normalize
    module when asked."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers 6 moved the modules
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    raw = make_encoder(path + "_raw", family, **kwargs)
    transformer = Transformer(raw, max_seq_length=max_seq_length)
    dim = (transformer.get_embedding_dimension() if hasattr(transformer, "get_embedding_dimension")
           else transformer.get_word_embedding_dimension())
    modules = [transformer, Pooling(dim, pooling_mode=pooling)]
    torch.manual_seed(kwargs.get("seed", 0) + 100)
    for layer in dense or []:
        modules.append(Dense(dim, **layer))
        dim = layer["out_features"]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(path)
    return path
