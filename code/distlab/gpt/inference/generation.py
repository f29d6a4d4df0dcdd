"""Autoregressive generation: the next token from the last position's logits, one at a time.

For a prompt x_1 .. x_P and step t = 1 .. N::

    z        = logits(x_1 .. x_{P+t-1})[last]  (V,)  with a KV cache: the model runs on x_{P+t-1}
                                                      only, after the prompt once (kv_cache.py)
    z[V_tok:] = -inf                            the padded ids (see hf_checkpoint.py) are never drawn
    temperature 0: x_{P+t} = argmax z           greedy; ties to the lowest id (torch.argmax)
    else      p = softmax(z / temperature), restricted to the top_k largest (top_k > 0) and to the
              smallest set of most likely ids whose mass reaches top_p (nucleus; Holtzman et al.
              2020), renormalised; x_{P+t} ~ p with a torch.Generator seeded by ``seed``

Generation stops after N tokens, or after the end-of-text id when one is given (as transformers'
``eos_token_id``). transformers applies the same steps in the same order (temperature, top-k,
top-p: its ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from distlab.gpt.inference.architecture import ConversionError
from distlab.gpt.inference.kv_cache import KVCache
from distlab.gpt.transformer.gpt_model import GPTModel


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (``generate.py``'s flags)."""

    temperature: float = 0.0
    """0: greedy (argmax); else the logits are divided by it before the softmax."""
    top_k: int = 0
    """Keep the k most likely ids (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely ids whose probability reaches top_p (1: all)."""
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConversionError(
                f"--temperature {self.temperature} (>= 0), --top-k {self.top_k} (>= 0) and --top-p "
                f"{self.top_p} (in (0, 1]) are out of range"
            )


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits (b, V) -> ids (b,)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    z = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(z, min(sampling.top_k, z.shape[-1]), dim=-1).values[..., -1:]  # (b, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_z, order = torch.sort(z, descending=True, dim=-1)
        before = sorted_z.softmax(-1).cumsum(-1) - sorted_z.softmax(-1)  # mass of the likelier ids
        drop_sorted = before >= sampling.top_p  # (b, V) in sorted order
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back in id order
        z = z.masked_fill(drop, float("-inf"))  # the most likely id is always kept (before = 0)
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """The tokens (prompt and new) and the clock of every new token."""

    tokens: list[int]
    new: int
    step_s: list[float] = field(default_factory=list)  # seconds per new token, the first includes the prompt

    def tokens_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s) if self.step_s else 0.0

    def ms_per_token(self, part: slice) -> float:
        """Median milliseconds of the new tokens in ``part`` (e.g. the first and the last quarter;
        the median: a busy machine's stalls are outliers)."""
        steps = self.step_s[part]
        return 1000 * statistics.median(steps) if steps else 0.0


def check_length(prompt: int, max_new_tokens: int, positions: int) -> None:
    """The prompt and the new tokens must fit the model's T_max learned positions."""
    if prompt < 1:
        raise ConversionError("the prompt is empty: give --prompt TEXT or --prompt-ids '1 2 3'")
    if prompt + max_new_tokens > positions:
        raise ConversionError(
            f"the prompt ({prompt} tokens) and --max-new-tokens {max_new_tokens} exceed the model's "
            f"{positions} positions (--max-position-embeddings): shorten the prompt or ask for at "
            f"most {max(positions - prompt, 0)} new tokens"
        )


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    *,
    use_cache: bool = True,
    vocab: int | None = None,
    eos: int | None = None,
) -> Generation:
    """Extend ``prompt`` by up to ``max_new_tokens`` ids (see the module docstring); ``vocab``:
    the tokenizer's V_tok (ids from there on are padding); ``eos``: stop after it."""
    positions = model.cfg.max_position_embeddings
    check_length(len(prompt), max_new_tokens, positions)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], device=device)  # (1, P)
    cache = KVCache(len(prompt) + max_new_tokens) if use_cache else None
    out = Generation(list(prompt), 0)
    step_in = tokens
    for _ in range(max_new_tokens):
        started = time.perf_counter()
        logits = model(step_in, cache=cache)[:, -1] if cache is not None else model(tokens)[:, -1]  # (1, V)
        if cache is not None:
            cache.advance(step_in.shape[1])
        if vocab is not None:
            logits[:, vocab:] = float("-inf")
        nxt = next_token(logits, sampling, generator)  # (1,)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        step_in = nxt[:, None]  # (1, 1): the cache holds the rest
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.step_s.append(time.perf_counter() - started)
        out.tokens.append(int(nxt))
        out.new += 1
        if eos is not None and int(nxt) == eos:
            break
    return out
