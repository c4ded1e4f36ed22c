"""Quality of a compression profile on a real model and real text (KVServe's "relative accuracy").

Protocol, per workload class (``prose``/``code``/``docs``, see corpus.py), with ``samples`` windows of
``prefix + continuation + 1`` tokens (``prefixes`` gives several prefix lengths, the windows split evenly):

1. Prefix pass (fp32 compute; K/V stored as BF16, as the engine stores them) captures each window's prefix
   KV, a BF16 tensor [layers, 2, prefix, kv_heads, head_dim]; a ``PrefixCache`` keeps it on disk.
2. Reference: the ``continuation`` tokens run teacher-forced, attending causally to [prefix KV ; their own KV];
   its log-probs are kept in memory, so each profile costs one pipeline pass and one continuation run.
3. A profile: the prefix KV goes through the pipeline (encode -> decode; pruned positions are masked out of
   attention) and step 2 is repeated on the decoded KV.

Metrics over the ``samples * continuation`` scored positions (position t predicts token t+1):

* ``accuracy``: argmax == true next token; ``reference_accuracy`` the same for uncompressed KV.
* ``relative_accuracy = accuracy / reference_accuracy`` — the paper's relative accuracy; the profile
  *quality*. It can exceed 1 by chance (a quantised run may guess a few more tokens right). ``ci_low`` /
  ``ci_high``: its bootstrap interval over windows (bootstrap.py says why windows and how).
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

from .bootstrap import BootstrapConfig, ratio_interval
from .pipeline import Pipeline
from .prefix_cache import PrefixCache
from .spec import StageSpec, format_spec, parse_spec

Masks = list[torch.Tensor | None]


@dataclass(frozen=True)
class QualityConfig:
    prefix: int = 512
    continuation: int = 64
    samples: int = 4
    prefixes: tuple[int, ...] = ()  # several prefix lengths (samples split evenly, in this order); () = (prefix,)
    resamples: int = 2000  # bootstrap resamples of the windows
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefix", "continuation", "samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"QualityConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.prefixes, tuple) or any(not isinstance(p, int) or p < 1 for p in self.prefixes):
            raise ValueError(f"QualityConfig.prefixes must be a tuple of ints >= 1, got {self.prefixes!r}")
        if self.prefixes and self.samples % len(self.prefixes):
            raise ValueError(f"QualityConfig.samples ({self.samples}) must be a multiple of len(prefixes) "
                             f"({len(self.prefixes)})")
        BootstrapConfig(self.resamples, self.confidence, self.seed)  # fails fast on resamples, confidence, seed

    @property
    def bootstrap(self) -> BootstrapConfig:
        return BootstrapConfig(self.resamples, self.confidence, self.seed)

    @property
    def prefix_lengths(self) -> tuple[int, ...]:
        """The prefix length of each window, in window order."""
        ps = self.prefixes or (self.prefix,)
        return tuple(p for p in ps for _ in range(self.samples // len(ps)))

    @property
    def window_lengths(self) -> tuple[int, ...]:
        return tuple(p + self.continuation + 1 for p in self.prefix_lengths)

    @property
    def window(self) -> int:
        """The longest window's length (all of them when there is a single prefix length)."""
        return max(self.window_lengths)

    @property
    def scored_positions(self) -> int:
        return self.samples * self.continuation


@dataclass(frozen=True)
class QualityResult:
    relative_accuracy: float
    agreement: float
    kl: float
    accuracy: float
    reference_accuracy: float
    tokens: int
    ci_low: float = float("nan")  # bootstrap interval of relative_accuracy (QualityConfig.confidence)
    ci_high: float = float("nan")
    window_correct: tuple[int, ...] = ()  # per window: positions right with the profile's KV
    window_reference_correct: tuple[int, ...] = ()  # ... with BF16 KV
    window_agree: tuple[int, ...] = ()
    window_kl: tuple[float, ...] = ()  # summed over the window's positions
    window_tokens: tuple[int, ...] = ()
    strata: tuple[str, ...] = ()  # each window's bootstrap stratum (its prefix length, and workload if pooled)

    @property
    def quality(self) -> float:
        """What the profiler and controller call quality: the relative accuracy."""
        return self.relative_accuracy

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """The figures without the per-window counts."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("window_") and k != "strata"}


def result_from_windows(correct: Sequence[int], reference: Sequence[int], agree: Sequence[int],
                        kl: Sequence[float], tokens: Sequence[int], strata: Sequence[str],
                        config: BootstrapConfig) -> QualityResult:
    """Pooled metrics and the window bootstrap interval from per-window counts."""
    n, c, r = sum(tokens), sum(correct), sum(reference)
    if r == 0:
        raise ValueError("uncompressed KV predicts no token right: relative accuracy is undefined")
    lo, hi = ratio_interval(correct, reference, strata, config)
    return QualityResult(c / r, sum(agree) / n, max(sum(kl) / n, 0.0), c / n, r / n, n, lo, hi,
                         tuple(correct), tuple(reference), tuple(agree), tuple(kl), tuple(tokens), tuple(strata))


def pool(results: dict[str, QualityResult], config: BootstrapConfig) -> QualityResult:
    """One result over the union of several evaluations' windows (a mixed data set, e.g. prose + code);
    strata become ``<name>:<stratum>``."""
    if not results:
        raise ValueError("nothing to pool")
    cols: dict[str, list] = {k: [] for k in ("c", "r", "a", "kl", "n", "s")}
    for name, q in results.items():
        if not q.window_tokens:
            raise ValueError(f"{name}: result has no per-window counts to pool")
        cols["c"] += q.window_correct
        cols["r"] += q.window_reference_correct
        cols["a"] += q.window_agree
        cols["kl"] += q.window_kl
        cols["n"] += q.window_tokens
        cols["s"] += [f"{name}:{s}" for s in q.strata]
    return result_from_windows(cols["c"], cols["r"], cols["a"], cols["kl"], cols["n"], cols["s"], config)


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


def continuation_hidden(model: torch.nn.Module, kv: torch.Tensor, ids: torch.Tensor,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher-forced final hidden states [S*N, hidden] of ``ids`` [S, N] placed after the prefix KV ``kv``
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
        return model.hidden_states(ids.reshape(-1), (P + torch.arange(N)).repeat(S), attention)


def logprobs(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model.logits(hidden), -1)


def continuation_logprobs(model: torch.nn.Module, kv: torch.Tensor, ids: torch.Tensor,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher-forced log-probs [S*N, vocab] (see ``continuation_hidden``)."""
    return logprobs(model, continuation_hidden(model, kv, ids, keep))


# Reference log-probs kept per evaluator up to this many bytes; beyond (a large vocabulary), the reference's
# final hidden states are kept and its log-probs recomputed at each score (same inputs, same values).
REFERENCE_LOGITS_BUDGET = 1 << 30


class QualityEvaluator:
    """Holds one (model, windows) reference so that each profile costs one pipeline pass and one short run
    per window. Windows are run one at a time: memory stays at one window's activations and logits."""

    def __init__(self, model: torch.nn.Module, windows: Sequence[Sequence[int]], config: QualityConfig,
                 cache: PrefixCache | None = None) -> None:
        self.model, self.cfg = model, config
        lengths = config.window_lengths
        if len(windows) != config.samples or any(len(w) != n for w, n in zip(windows, lengths)):
            raise ValueError(f"need {config.samples} windows of {sorted(set(lengths))} tokens (in config order), "
                             f"got {[len(w) for w in windows]}")
        limit = model.args.max_position_embeddings
        if hasattr(model, "rope_cos"):
            limit = min(limit, int(model.rope_cos.shape[0]))
        if config.window - 1 > limit:
            raise ValueError(f"windows of {config.window} tokens exceed the model's {limit} positions")
        self.cache = cache
        self.kv: list[torch.Tensor] = []
        self.cont_ids: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self._ref: list[torch.Tensor] = []  # per window: log-probs, or final hidden states (see the budget)
        self.ref_top: list[torch.Tensor] = []
        self._keep_logits = config.scored_positions * model.args.vocab_size * 4 <= REFERENCE_LOGITS_BUDGET
        for w, P in zip(windows, config.prefix_lengths):
            ids = torch.tensor(list(w), dtype=torch.long)
            pre = ids[:P]
            kv = (cache.get(model, pre, lambda: prefix_kv(model, pre[None])[0]) if cache is not None
                  else prefix_kv(model, pre[None])[0])
            cont = ids[P: P + config.continuation]
            h = continuation_hidden(model, kv[None], cont[None])
            logp = logprobs(model, h)
            self.kv.append(kv)
            self.cont_ids.append(cont)
            self.targets.append(ids[P + 1:])
            self._ref.append(logp if self._keep_logits else h)
            self.ref_top.append(logp.argmax(-1))
        self.ref_correct = [int((t == y).sum()) for t, y in zip(self.ref_top, self.targets)]
        self.strata = tuple(f"p{P}" for P in config.prefix_lengths)
        self.reference_accuracy = sum(self.ref_correct) / config.scored_positions
        if self.reference_accuracy == 0:
            raise ValueError("uncompressed KV predicts no token right: relative accuracy is undefined")

    @property
    def shape(self) -> tuple[int, ...]:
        """The first window's KV shape [layers, 2, prefix, kv_heads, head_dim]."""
        return tuple(self.kv[0].shape)

    def request_kv(self, i: int = 0) -> torch.Tensor:
        return self.kv[i]

    def reference_logprobs(self, i: int) -> torch.Tensor:
        """Window ``i``'s reference log-probs [continuation, vocab]."""
        return self._ref[i] if self._keep_logits else logprobs(self.model, self._ref[i])

    def score(self, kvs: Sequence[torch.Tensor], keeps: Sequence[torch.Tensor | None] | None = None) -> QualityResult:
        """Metrics of (already decoded) prefix KVs, one [layers, 2, P, Hk, D] per window, against the reference;
        ``keeps`` ([layers, P, Hk] bool or None per window) hides pruned positions."""
        if len(kvs) != len(self.kv):
            raise ValueError(f"need {len(self.kv)} windows' KV, got {len(kvs)}")
        keeps = keeps if keeps is not None else [None] * len(kvs)
        c, a, kl, n = [], [], [], []
        for i, (kv, keep) in enumerate(zip(kvs, keeps)):
            logp = continuation_logprobs(self.model, kv[None], self.cont_ids[i][None], None if keep is None else keep[None])
            top = logp.argmax(-1)
            ref = self.reference_logprobs(i)
            c.append(int((top == self.targets[i]).sum()))
            a.append(int((top == self.ref_top[i]).sum()))
            kl.append(float((ref.exp() * (ref - logp)).sum()))
            n.append(int(top.numel()))
        return result_from_windows(c, self.ref_correct, a, kl, n, self.strata, self.cfg.bootstrap)

    def decoded(self, spec: str, head_scores: torch.Tensor | None = None, keep_codec: bool = False
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Each window's prefix KV through ``spec`` (encode -> decode) and its kept-position mask or None."""
        p = Pipeline(spec if keep_codec else quality_spec(spec), head_scores)
        kvs, keeps = [], []
        for kv in self.kv:
            dec, masks = p.decode_with_mask(p.encode({"0": kv}))
            m = masks["0"]
            kvs.append(dec["0"])
            keeps.append(None if m is None else m[:, 0] & m[:, 1])  # [layers, P, Hk]
        return kvs, keeps

    def evaluate(self, spec: str, head_scores: torch.Tensor | None = None, keep_codec: bool = False) -> QualityResult:
        """Compress and decompress every window's prefix KV with ``spec``, then score the continuations."""
        return self.score(*self.decoded(spec, head_scores, keep_codec))


@functools.lru_cache(maxsize=4)
def bundled_model(name: str) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a bundled model in fp32 on CPU, loaded once per process."""
    from kvtide.models.loader import load_model
    model, tok, _ = load_model(name)
    return model, tok


_EVALUATORS: dict[tuple, QualityEvaluator] = {}


def evaluator(model_name: str, workload: str, config: QualityConfig | None = None,
              cache_dir: str | None = None) -> QualityEvaluator:
    """The evaluator (reference run included) for a bundled model and a workload class, kept in memory per
    process; ``cache_dir`` also keeps the windows' prefix KV on disk (``PrefixCache``)."""
    from .corpus import windows_of
    cfg = config or QualityConfig()
    key = (model_name, workload, cfg)
    if key not in _EVALUATORS:
        model, tok = bundled_model(model_name)
        cache = PrefixCache(cache_dir) if cache_dir else None
        _EVALUATORS[key] = QualityEvaluator(model, windows_of(tok, workload, cfg.window_lengths), cfg, cache)
    return _EVALUATORS[key]
