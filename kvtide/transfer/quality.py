"""Quality of a compression profile on a real model and real text (KVServe's "relative accuracy").

Protocol, per workload class (``prose``/``code``, see corpus.py), with ``samples`` windows of
``prefix + continuation + 1`` tokens:

1. Prefix pass (fp32 compute; K/V stored as BF16, as the engine stores them) captures each sample's prefix
   KV, a BF16 tensor [layers, 2, prefix, kv_heads, head_dim].
2. Reference: the ``continuation`` tokens run teacher-forced, attending causally to [prefix KV ; their own KV].
3. A profile: the prefix KV goes through the pipeline (encode -> decode; pruned positions are masked out of
   attention) and step 2 is repeated on the decoded KV.

Metrics over the ``samples * continuation`` scored positions (position t predicts token t+1):

* ``accuracy``: argmax == true next token; ``reference_accuracy`` the same for uncompressed KV.
* ``relative_accuracy = accuracy / reference_accuracy`` — the paper's relative accuracy; the profile
  *quality*. It can exceed 1 by chance (a quantised run may guess a few more tokens right).
* ``agreement``: argmax equals the uncompressed run's argmax (a stricter, lower-variance view).
* ``kl``: mean KL(P_uncompressed || P_compressed) of the next-token distributions, in nats.

A lossless pipeline decodes to the identical BF16 tensor, and the same code runs the same shapes, so it
scores exactly 1.0 / 1.0 / 0.0. Codecs are exact, so quality depends only on transform and quantizer:
``evaluate`` swaps the codec for ``none`` (same values, less time) unless ``keep_codec`` is set.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .pipeline import Pipeline
from .spec import StageSpec, format_spec, parse_spec

Masks = list[torch.Tensor | None]


@dataclass(frozen=True)
class QualityConfig:
    prefix: int = 512
    continuation: int = 64
    samples: int = 4

    def __post_init__(self) -> None:
        if self.prefix < 1 or self.continuation < 1 or self.samples < 1:
            raise ValueError(f"prefix, continuation and samples must be >= 1, got {self}")

    @property
    def window(self) -> int:
        return self.prefix + self.continuation + 1


@dataclass(frozen=True)
class QualityResult:
    relative_accuracy: float
    agreement: float
    kl: float
    accuracy: float
    reference_accuracy: float
    tokens: int

    @property
    def quality(self) -> float:
        """What the profiler and controller call quality: the relative accuracy."""
        return self.relative_accuracy

    def as_dict(self) -> dict:
        return asdict(self)


def quality_spec(spec: str) -> str:
    """The canonical spec with its codec replaced by ``none``: same decoded values (codecs are exact), cheaper."""
    t, q, _ = parse_spec(spec)
    return Pipeline(format_spec((t, q, StageSpec("none")))).to_spec()


def _gqa(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def prefix_kv(model: torch.nn.Module, ids: torch.Tensor,
              probe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Run ``ids`` [S, P] causally; return their KV as BF16 [S, layers, 2, P, kv_heads, head_dim].

    ``probe(layer, q, k)`` (q [S, Hq, P, D], k [S, Hq, P, D] after GQA expansion, BF16-rounded) sees each
    layer's queries and keys, for offline measurements such as head scores.
    """
    S, P = ids.shape
    a = model.args
    g = a.num_heads // a.num_kv_heads
    kv = torch.empty(S, a.num_layers, 2, P, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.view(S, P, *k.shape[1:]), v.view(S, P, *v.shape[1:])
        kv[:, layer, 0], kv[:, layer, 1] = k, v
        qh = q.view(S, P, *q.shape[1:]).transpose(1, 2)
        kh, vh = (_gqa(_bf16(t).transpose(1, 2), g) for t in (k, v))
        if probe is not None:
            probe(layer, qh, kh)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return o.transpose(1, 2).reshape(S * P, *q.shape[1:])

    with torch.no_grad():
        model.hidden_states(ids.reshape(-1), torch.arange(P).repeat(S), attention)
    return kv


def continuation_logprobs(model: torch.nn.Module, kv: torch.Tensor, ids: torch.Tensor,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher-forced log-probs [S*N, vocab] of ``ids`` [S, N] placed after the prefix KV ``kv``
    ([S, layers, 2, P, Hk, D] BF16); ``keep`` ([S, layers, P, Hk] bool) hides pruned prefix positions."""
    S, N = ids.shape
    P = kv.shape[3]
    a = model.args
    g = a.num_heads // a.num_kv_heads
    causal = torch.cat([torch.ones(N, P, dtype=torch.bool), torch.ones(N, N, dtype=torch.bool).tril()], 1)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh = q.view(S, N, *q.shape[1:]).transpose(1, 2)
        own = [_bf16(t.view(S, N, *t.shape[1:])) for t in (k, v)]
        kh, vh = (_gqa(torch.cat([kv[:, layer, j].float(), own[j]], 1).transpose(1, 2), g) for j in (0, 1))
        mask = causal
        if keep is not None:
            m = _gqa(keep[:, layer].transpose(1, 2), g)[:, :, None, :]  # [S, Hq, 1, P]
            mask = torch.cat([m.expand(S, m.shape[1], N, P), causal[None, None, :, P:].expand(S, m.shape[1], N, N)], 3)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return o.transpose(1, 2).reshape(S * N, *q.shape[1:])

    with torch.no_grad():
        h = model.hidden_states(ids.reshape(-1), (P + torch.arange(N)).repeat(S), attention)
        return torch.log_softmax(model.logits(h), -1)


class QualityEvaluator:
    """Holds one (model, texts) reference so that each profile costs one pipeline pass and one short run."""

    def __init__(self, model: torch.nn.Module, windows: Sequence[Sequence[int]], config: QualityConfig) -> None:
        self.model, self.cfg = model, config
        if len(windows) != config.samples or any(len(w) != config.window for w in windows):
            raise ValueError(f"need {config.samples} windows of {config.window} tokens")
        ids = torch.tensor([list(w) for w in windows], dtype=torch.long)
        P = config.prefix
        self.cont_ids = ids[:, P: P + config.continuation]
        self.targets = ids[:, P + 1:].reshape(-1)
        self.kv = prefix_kv(model, ids[:, :P])
        self.ref_logp = continuation_logprobs(model, self.kv, self.cont_ids)
        self.ref_top = self.ref_logp.argmax(-1)
        self.reference_accuracy = float((self.ref_top == self.targets).float().mean())
        if self.reference_accuracy == 0:
            raise ValueError("uncompressed KV predicts no token right: relative accuracy is undefined")

    @property
    def shape(self) -> tuple[int, ...]:
        """One request's KV shape [layers, 2, prefix, kv_heads, head_dim]."""
        return tuple(self.kv.shape[1:])

    def request_kv(self, i: int = 0) -> torch.Tensor:
        return self.kv[i]

    def score(self, kv: torch.Tensor, keep: torch.Tensor | None = None) -> QualityResult:
        """Metrics of an (already decoded) prefix KV [S, layers, 2, P, Hk, D] against the reference."""
        logp = continuation_logprobs(self.model, kv, self.cont_ids, keep)
        top = logp.argmax(-1)
        acc = float((top == self.targets).float().mean())
        kl = float((self.ref_logp.exp() * (self.ref_logp - logp)).sum(-1).mean())
        return QualityResult(acc / self.reference_accuracy, float((top == self.ref_top).float().mean()),
                             max(kl, 0.0), acc, self.reference_accuracy, int(top.numel()))

    def evaluate(self, spec: str, head_scores: torch.Tensor | None = None, keep_codec: bool = False) -> QualityResult:
        """Compress and decompress every sample's prefix KV with ``spec``, then score the continuation."""
        p = Pipeline(spec if keep_codec else quality_spec(spec), head_scores)
        blob = p.encode({str(i): self.kv[i] for i in range(self.kv.shape[0])})
        dec, masks = p.decode_with_mask(blob)
        kv = torch.stack([dec[str(i)] for i in range(self.kv.shape[0])])
        keep = None
        if any(m is not None for m in masks.values()):
            full = torch.ones(self.kv.shape[1:3] + self.kv.shape[3:5], dtype=torch.bool)
            ms = [masks[str(i)] if masks[str(i)] is not None else full for i in range(self.kv.shape[0])]
            keep = torch.stack([m[:, 0] & m[:, 1] for m in ms])  # [S, layers, P, Hk]
        return self.score(kv, keep)


@functools.lru_cache(maxsize=4)
def bundled_model(name: str) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a bundled model in fp32 on CPU, loaded once per process."""
    from kvtide.models.loader import load_model
    model, tok, _ = load_model(name)
    return model, tok


_EVALUATORS: dict[tuple, QualityEvaluator] = {}


def evaluator(model_name: str, workload: str, config: QualityConfig | None = None) -> QualityEvaluator:
    """The cached evaluator (reference run included) for a bundled model and a workload class."""
    from .corpus import windows
    cfg = config or QualityConfig()
    key = (model_name, workload, cfg)
    if key not in _EVALUATORS:
        model, tok = bundled_model(model_name)
        _EVALUATORS[key] = QualityEvaluator(model, windows(tok, workload, cfg.samples, cfg.window), cfg)
    return _EVALUATORS[key]

