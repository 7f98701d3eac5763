"""A graph's nodes as the steps the interpreter runs: each bound kernel with the value names it reads and
writes, whether it gets a copy of an input (it writes that input in place and the value is read again),
and the values whose last reader it is (freed after it). `GraphModel` runs its body and head as step
lists; a decoder layer's mixture MLP runs its share of them as a module (`layers.GraphMLP`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class Step:
    kernel: nn.Module | None  # None: the standard ops the interpreter does itself (Identity)
    inputs: list[str]  # value names passed to the kernel, in its order
    outputs: list[str]
    copy: list[bool]  # hand the kernel a copy (it writes that input in place and the value is read later)
    drop: list[str]  # values whose last reader this is


def schedule(built: list[tuple[nn.Module | None, list[str], list[str]]], keep: set[str]) -> list[Step]:
    """(kernel, inputs, outputs) in graph order -> steps; `keep`: values never freed (the results)."""
    last: dict[str, int] = {}
    for i, (_, inputs, _) in enumerate(built):
        for name in inputs:
            last[name] = i
    steps = []
    for i, (kernel, inputs, outputs) in enumerate(built):
        mutated = getattr(kernel, "mutates", ())
        copy = [slot in mutated and (last[name] > i or name in keep or inputs.count(name) > 1)
                for slot, name in enumerate(inputs)]
        drop = sorted({n for n in inputs if last[n] == i and n not in keep})
        steps.append(Step(kernel, inputs, outputs, copy, drop))
    return steps


def run_steps(steps: list[Step], values: dict[str, Any]) -> None:
    """Run `steps` over `values` (name -> tensor), which gains each step's outputs."""
    for step in steps:
        try:
            args = [values[n].clone() if c else values[n] for n, c in zip(step.inputs, step.copy)]
        except KeyError as exc:
            raise ValueError(f"graph value {exc} is read before any node writes it.") from None
        # forward itself: no hooks are put on a graph's kernels, and Module.__call__'s checks for them cost a
        # few microseconds a node, every node of every interpreted step (OPT's, latent attention's decode)
        out = args[0] if step.kernel is None else step.kernel.forward(*args)
        if isinstance(out, tuple):
            values.update(zip(step.outputs, out))
        else:
            values[step.outputs[0]] = out
        for name in step.drop:
            values.pop(name, None)
