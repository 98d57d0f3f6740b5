"""Token sampling: the one entry point the CLI, the Python API and the server share.

One `Sampler` per sequence (per choice). Each step it takes the backend's float32 logits for
the next position (151,936 of them) and the token ids so far (prompt and generated), and
returns one token id. It never writes to the caller's logits.

The order of operations is in `Sampler.sample`'s docstring. `logprobs` reports log-softmax of
the RAW model logits (before bias, penalties and temperature), as OpenAI-style logprobs do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kipp.errors import KippError

VOCAB_SIZE = 151_936
MAX_TOP_LOGPROBS = 20
_SEED_LIMIT = 2**64
# The full-vocab inverse CDF runs in two levels (block sums, then one block) so that no
# 151,936-long cumulative sum is needed per token.
_BLOCK = 128
# top_p buckets weights by their float32 bits >> 16 (exponent and 7 mantissa bits: buckets
# under 1% wide, in value order) and sorts only the bucket where the cut falls.
_KEY_SHIFT = 16
_SMALL_TOP_P = 1024
# Before the buckets, top_p tries the weights at or above each floor (the top weight is 1): a
# sampled model's top_p mass mostly lies within a few nats of its top token, and those few
# candidates sort faster than the vocab buckets.
_TOP_P_FLOORS = (2.0 ** -8, 2.0 ** -16)
# A positive temperature below this would round to float32 zero and make 0/0 of the top
# logit; at this size every non-top weight already underflows to 0.
_MIN_TEMPERATURE = 1e-30


class SamplingError(KippError, ValueError):
    """A sampling parameter or a sampler input is out of range; the message names it."""


def _number(name, value, low, high, *, low_open=False, high_open=False):
    """Validate a finite real in [low, high] (either end open, None = unbounded) -> float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    value = float(value)
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{low} {'<' if low_open else '<='} "
        hi = "" if high is None else f" {'<' if high_open else '<='} {high}"
        raise SamplingError(f"{name}={value!r} is out of range: need {lo}{name}{hi}")
    return value


def _integer(name, value, low, high=None):
    """Validate an int in [low, high) (high None = unbounded) -> int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f"{low} <= {name}" + ("" if high is None else f" < {high}")
        raise SamplingError(f"{name}={value} is out of range: need {bound}")
    return value


def _logit_bias_pairs(value):
    """Mapping or (id, bias) pairs -> sorted tuple of (int, float): hashable and immutable."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token, bias) for token, bias in items]
    except (TypeError, ValueError):
        raise SamplingError(f"logit_bias must map token ids to biases, got {value!r}") from None
    out = {}
    for token, bias in pairs:
        token = _integer("logit_bias token id", token, 0, VOCAB_SIZE)
        if token in out:
            raise SamplingError(f"logit_bias lists token id {token} twice")
        out[token] = _number(f"logit_bias[{token}]", bias, -100.0, 100.0)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Ranges follow OpenAI where OpenAI defines the field.

    logit_bias accepts a mapping {token id: bias} (or (id, bias) pairs) and is stored as a
    sorted tuple of pairs, so the params stay frozen and hashable.
    """

    temperature: float = 1.0  # 0 = greedy argmax
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style; 1 = off
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = None  # None = fresh OS entropy per Sampler
    penalty_window: int = 64  # most recent ids (prompt + generated) the penalties count

    def __post_init__(self):
        checked = {
            "temperature": _number("temperature", self.temperature, 0.0, None),
            "top_p": _number("top_p", self.top_p, 0.0, 1.0, low_open=True),
            "top_k": _integer("top_k", self.top_k, 0),
            "min_p": _number("min_p", self.min_p, 0.0, 1.0),
            "frequency_penalty": _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "presence_penalty": _number("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "repetition_penalty": _number(
                "repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True
            ),
            "logit_bias": _logit_bias_pairs(self.logit_bias),
            "seed": None if self.seed is None else _integer("seed", self.seed, 0, _SEED_LIMIT),
            "penalty_window": _integer("penalty_window", self.penalty_window, 0),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """True when sampling is a deterministic argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.penalty_window > 0 and (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_logits(logits, vocab_size) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    if x.shape != (vocab_size,):
        raise SamplingError(f"logits must have shape ({vocab_size},), got {x.shape}")
    return x


def _window(recent_tokens: Sequence[int], size: int, vocab_size: int) -> np.ndarray:
    """The last `size` ids of the sequence, validated, as int64."""
    n = len(recent_tokens)
    start = max(0, n - size)
    ids = np.fromiter((recent_tokens[i] for i in range(start, n)), dtype=np.int64, count=n - start)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise SamplingError(f"recent_tokens holds id {bad}, outside 0..{vocab_size - 1}")
    return ids


def _adjust_in_place(x: np.ndarray, recent_tokens, params: SamplingParams) -> None:
    """Steps 1 and 2 of Sampler.sample, on x (float32, the caller's copy)."""
    for token, bias in params.logit_bias:
        if token >= x.size:
            raise SamplingError(f"logit_bias token id {token} is outside 0..{x.size - 1}")
        x[token] += np.float32(bias)
    if not params.has_penalties:
        return
    window = _window(recent_tokens, params.penalty_window, x.size)
    ids, counts = np.unique(window, return_counts=True)
    if ids.size == 0:
        return
    v = x[ids]
    r = np.float32(params.repetition_penalty)
    if r != 1:
        v = np.where(v > 0, v / r, v * r)
    v = v - (counts * params.frequency_penalty + params.presence_penalty)
    x[ids] = v


def _mask_in_place(x: np.ndarray, allowed: np.ndarray, scratch: np.ndarray) -> None:
    """Step 2b: x[id] = -inf for every id the mask does not allow."""
    if allowed.shape != x.shape or allowed.dtype != np.bool_:
        raise SamplingError(f"allowed must be a bool mask of shape {x.shape}, got "
                            f"{allowed.dtype} {allowed.shape}")
    if not allowed.any():
        raise SamplingError("the grammar allows no token here")
    np.putmask(x, np.logical_not(allowed, out=scratch), np.float32(-np.inf))


def adjusted_logits(
    logits: np.ndarray, recent_tokens: Sequence[int], params: SamplingParams
) -> np.ndarray:
    """A new float32 array: the logits after logit_bias and the window penalties."""
    x = np.array(logits, dtype=np.float32, copy=True)
    _adjust_in_place(x, recent_tokens, params)
    return x


def _max_finite(x: np.ndarray) -> float:
    m = float(x.max())  # NaN anywhere propagates into the max
    if not math.isfinite(m):
        raise SamplingError(f"logits must be finite (or -inf), found maximum {m}")
    return m


def sample_greedy(logits: np.ndarray) -> int:
    """Argmax of the logits; ties go to the lowest id."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise SamplingError(f"logits must be one non-empty row, got shape {x.shape}")
    _max_finite(x)
    return int(np.argmax(x))


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest values; ties at the boundary keep the lowest ids."""
    kth = np.partition(x, x.size - k)[x.size - k]
    ids = np.flatnonzero(x >= kth)
    if ids.size > k:  # ties at the k-th value: drop the highest tied ids
        tied = ids[x[ids] == kth]
        drop = tied[k - ids.size :]
        ids = np.setdiff1d(ids, drop, assume_unique=True)
    return ids


def _top_p_prefix(w: np.ndarray, target: float) -> np.ndarray | None:
    """Mask over w of the shortest weight-ordered prefix whose sum reaches target.

    Ties go to the lower position (positions ascend with token id). None when even all of w
    falls short of target (only through rounding).
    """
    desc = np.sort(w)[::-1].astype(np.float64)
    cut = int(np.searchsorted(np.cumsum(desc), target, side="left")) + 1
    if cut > desc.size:
        return None
    last = w.dtype.type(desc[cut - 1])
    keep = w > last
    tied = np.flatnonzero(w == last)
    keep[tied[: cut - int(keep.sum())]] = True
    return keep


def _top_p_mask(w, top_p, wide, keys, keep) -> np.ndarray | None:
    """Fill keep (bool) with the top_p set of non-negative float32 weights w; None = keep all.

    A full sort of the vocab costs milliseconds, so: where the weights at or above a floor
    (_TOP_P_FLOORS) are few and hold top_p of the mass, the cut lies among them and only they
    are sorted (every weight outside is smaller); else histogram the weights into
    value-ordered buckets, keep every bucket above the one where the cumulative mass reaches
    top_p, and sort only that one bucket. wide (float64) and keys (intp) are scratch arrays as
    long as w.
    """
    if w.size <= _SMALL_TOP_P:  # top_k candidates: sorting them is cheaper than the buckets
        return _top_p_prefix(w, top_p * w.sum(dtype=np.float64))
    np.copyto(wide, w)
    target = top_p * wide.sum()
    for floor in _TOP_P_FLOORS:
        if np.count_nonzero(np.greater_equal(w, np.float32(floor), out=keep)) > _SMALL_TOP_P:
            break
        head = np.flatnonzero(keep)
        part = w[head]
        if part.sum(dtype=np.float64) < target:  # the cut lies below this floor
            continue
        in_head = _top_p_prefix(part, target)
        if in_head is not None:
            keep.fill(False)
            keep[head[in_head]] = True
            return keep
    np.right_shift(w.view(np.int32), _KEY_SHIFT, out=keys)  # floats >= 0: bits sort as values
    above = np.cumsum(np.bincount(keys, weights=wide)[::-1])[::-1]  # mass of keys >= k
    b = int(np.count_nonzero(above >= target)) - 1
    if b < 0:  # rounding left the total short of the target
        return None
    band = np.flatnonzero(np.equal(keys, b, out=keep))
    rest = target - (above[b + 1] if b + 1 < above.size else 0.0)
    in_band = _top_p_prefix(w[band], rest)
    np.greater(keys, b, out=keep)
    keep[band if in_band is None else band[in_band]] = True
    return keep


def _draw_from(ids: np.ndarray, w: np.ndarray, u: float) -> int:
    """Inverse CDF over ids (ascending) with weights w (some weight > 0)."""
    cdf = np.cumsum(w.astype(np.float64))  # cumsum(dtype=float64) on float32 is ~10x slower
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if j >= cdf.size:  # u * total rounded up to the total: take the last token with weight
        j = int(np.flatnonzero(w)[-1])
    return int(ids[j])


def _draw_nonzero(w: np.ndarray, u: float) -> int:
    """Inverse CDF over the ids of w (float64 [vocab]) with weight > 0, in ascending order, in
    _draw_full's two levels: listing a sampled row's nonzero ids and summing them all costs
    a millisecond at every token a draft model samples."""
    if w.size % _BLOCK:
        w = np.pad(w, (0, -w.size % _BLOCK))
    return _draw_full(w, u)


def _normalised(size: int, ids: np.ndarray | None, w: np.ndarray) -> np.ndarray:
    """The kept weights (over `ids`; None: every id) as a float64 distribution [size]."""
    out = np.zeros(size, dtype=np.float64)
    if ids is None:
        out[:] = w[:size]
    else:
        out[ids] = w
    out /= out.sum()
    return out


def _draw_full(w: np.ndarray, u: float) -> int:
    """Inverse CDF over every id of w (length a multiple of _BLOCK, padded with zeros); an id
    of weight 0 is never drawn (its CDF step is empty)."""
    blocks = w.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    cdf = np.cumsum(blocks)
    target = u * cdf[-1]
    b = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
    while blocks[b] == 0.0:  # only reachable through rounding at the very end
        b -= 1
    rest = target - (cdf[b - 1] if b > 0 else 0.0)
    block = w[b * _BLOCK : (b + 1) * _BLOCK]
    return b * _BLOCK + _draw_from(np.arange(_BLOCK), block, rest / blocks[b])


class Sampler:
    """Samples the tokens of one sequence; owns its RNG, so choices never share draws.

    >>> sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    >>> token = sampler.sample(logits, tokens_so_far)  # doctest: +SKIP

    `choice` separates the streams of the n choices of one seeded request: the same
    (seed, choice) always gives the same draws, and different choices differ.
    A Sampler keeps ~25 bytes per vocab entry of scratch (3.8 MB): fresh megabyte-sized
    temporaries every token cost more in page faults than the arithmetic.
    """

    def __init__(self, params: SamplingParams, vocab_size: int = VOCAB_SIZE, *, choice: int = 0,
                 stream: int = 0):
        self.params = params
        self.vocab_size = n = _integer("vocab_size", vocab_size, 1)
        for token, _ in params.logit_bias:
            if token >= n:
                raise SamplingError(f"logit_bias token id {token} is outside 0..{n - 1}")
        # stream 0 is the choice's own draws; a speculative draft model samples from stream 1,
        # so drafting never shifts the draws of the choice's own sampler
        key = (_integer("choice", choice, 0),) + ((_integer("stream", stream, 0),) if stream
                                                   else ())
        seed = np.random.SeedSequence(params.seed, spawn_key=key)
        self.rng = np.random.default_rng(seed)
        self._logits = np.empty(n, dtype=np.float32)
        self._weights = np.zeros(-(-n // _BLOCK) * _BLOCK, dtype=np.float32)  # tail stays 0
        self._wide = np.empty(n, dtype=np.float64)
        self._keys = np.empty(n, dtype=np.intp)
        self._mask = np.empty(n, dtype=np.bool_)

    def sample(self, logits: np.ndarray, recent_tokens: Sequence[int] = (),
               allowed: np.ndarray | None = None) -> int:
        """One token id from logits [vocab] (float32), given the sequence so far. `allowed`
        (bool [vocab], a grammar's mask) restricts the pick to the ids it marks.

        In this order, x being a float32 copy of the logits:

        1. logit_bias: x[id] += bias, for every (id, bias) pair.
        2. penalties, over the last `penalty_window` ids of the sequence (prompt included); for
           each distinct id t in that window, occurring c times:
           a. repetition (CTRL): x[t] / r if x[t] > 0 else x[t] * r,
           b. frequency and presence: x[t] -= c * frequency_penalty + presence_penalty.
           Repetition comes first, as in llama.cpp's penalties step (llama.cpp's default chain
           applies temperature after top_k/top_p/min_p; Kipp applies it before, as listed
           here). `adjusted_logits` returns x after this step.
        2b. allowed (a grammar's mask, kipp.text.grammar): ids outside it get -inf, so no later
           step can pick them; greedy, top_k, top_p and min_p act on the admitted ids only.
        3. temperature == 0 (or top_k == 1): argmax of x; ties go to the lowest id; no RNG draw.
        4. otherwise divide by temperature; the weights are w = exp((x - max x) / T), so the
           most likely token has weight exactly 1.
        5. top_k: keep the k largest; ties at the boundary go to the lowest ids, so exactly k
           stay (and top_k == 1 is the greedy token).
        6. softmax over what is kept, then top_p: order by probability (ties: lower id first)
           and keep the shortest prefix whose cumulative probability reaches top_p (at least
           one token).
        7. min_p: drop tokens with p < min_p * p_max.
        8. renormalise and draw by inverse CDF over the kept ids in ascending id order, using
           exactly one uniform from the sampler's own RNG.
        """
        x, ids, w = self._weights_for(logits, recent_tokens, allowed)
        if w is None:
            return int(np.argmax(x))
        u = self.rng.random()
        return _draw_full(self._weights, u) if ids is None else _draw_from(ids, w, u)

    def probabilities(self, logits: np.ndarray, recent_tokens: Sequence[int] = (),
                      allowed: np.ndarray | None = None) -> np.ndarray:
        """The distribution `sample` draws from (steps 1-8 without the draw), float64 [vocab]:
        one-hot at the argmax when greedy. Draws nothing from the RNG."""
        x, ids, w = self._weights_for(logits, recent_tokens, allowed)
        if w is None:
            out = np.zeros(x.size, dtype=np.float64)
            out[int(np.argmax(x))] = 1.0
            return out
        return _normalised(x.size, ids, w)

    def draw(self, probabilities: np.ndarray) -> int:
        """One id from a distribution over the vocab (float64, sums to 1), one uniform."""
        return _draw_nonzero(probabilities, self.rng.random())

    def verify(self, logits: np.ndarray, recent_tokens: Sequence[int], allowed: np.ndarray | None,
               token: int, draft: np.ndarray | None = None) -> int:
        """The token at a drafted position, distributed exactly as `sample`'s (speculative
        sampling, Leviathan et al. 2023 / Chen et al. 2023).

        `token` was drawn from `draft` (float64 [vocab]; None: a deterministic drafter, all
        mass on `token`). With p = probabilities(logits, ...) and q = draft: keep `token` with
        probability min(1, p[token] / q[token]), else draw from max(0, p - q), renormalised.
        The result equals `token` exactly when it is kept. Greedy: the argmax, no draw."""
        x, ids, w = self._weights_for(logits, recent_tokens, allowed)
        if w is None:
            return int(np.argmax(x))
        p = _normalised(x.size, ids, w)
        q_token = 1.0 if draft is None else float(draft[token])
        if self.rng.random() * q_token < p[token]:  # u < p/q, without dividing by q
            return int(token)
        if draft is None:
            residual = p.copy()
            residual[token] = 0.0
        else:
            residual = np.maximum(p - draft, 0.0)
        if not residual.sum() > 0.0:  # only through rounding, where p and q agree: p itself
            residual = p
        return _draw_nonzero(residual, self.rng.random())

    def _weights_for(self, logits, recent_tokens, allowed):
        """Steps 1-7: (x, ids, w): x the adjusted float32 logits; w None when greedy, else the
        kept weights over ids (None: every id, w then a view of the scratch weights)."""
        x = _check_logits(logits, self.vocab_size)
        p = self.params
        if p.logit_bias or p.has_penalties or allowed is not None:  # a private copy
            np.copyto(self._logits, x)
            x = self._logits
            _adjust_in_place(x, recent_tokens, p)
            if allowed is not None:
                _mask_in_place(x, allowed, self._mask)
        m = np.float32(_max_finite(x))
        if p.is_greedy:
            return x, None, None
        t = np.float32(max(p.temperature, _MIN_TEMPERATURE))
        if 0 < p.top_k < x.size and allowed is not None:
            # partitioning a vocab of mostly -inf is ~15x slower: select among the admitted ids
            # only (the barred ones would carry weight 0, never drawn)
            admitted = np.flatnonzero(allowed)
            ids = admitted if admitted.size <= p.top_k else \
                admitted[_top_k_ids(x[admitted], p.top_k)]
            w = np.exp((x[ids] - m) / t)
        elif 0 < p.top_k < x.size:
            ids = _top_k_ids(x, p.top_k)
            w = np.exp((x[ids] - m) / t)
        else:
            ids = None
            w = self._weights[: x.size]  # the same arithmetic as the line above, in place
            np.subtract(x, m, out=w)
            np.divide(w, t, out=w)
            np.exp(w, out=w)
        self._truncate(w)
        return x, ids, w

    def _truncate(self, w: np.ndarray) -> None:
        """Steps 6 and 7: zero the weights top_p and min_p drop (w's top weight is exactly 1)."""
        p, k = self.params, w.size
        if p.top_p < 1.0:
            keep = _top_p_mask(w, p.top_p, self._wide[:k], self._keys[:k], self._mask[:k])
            if keep is not None:
                np.multiply(w, keep, out=w)
        if p.min_p > 0.0:  # p < min_p * p_max  <=>  w < min_p, as p_max has weight 1
            keep = np.greater_equal(w, np.float32(p.min_p), out=self._mask[:k])
            np.multiply(w, keep, out=w)


def _log_normaliser(x: np.ndarray) -> float:
    """log(sum(exp(x))), stably: exp in float32 (float64 exp over the vocab is ~8x slower),
    the sum in float64."""
    if x.ndim != 1 or x.size == 0:
        raise SamplingError(f"logits must be one non-empty row, got shape {x.shape}")
    m = _max_finite(x)
    return m + math.log(np.exp(x - np.float32(m)).sum(dtype=np.float64))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax of one row of logits, as float64."""
    x = np.asarray(logits, dtype=np.float32)
    return x.astype(np.float64) - _log_normaliser(x)


def logprobs(
    logits: np.ndarray, token_id: int, top_n: int = 0
) -> tuple[float, list[tuple[int, float]]]:
    """(log p of token_id, the top_n most likely (id, log p), highest first, ties by lower id).

    Computed from the RAW model logits: bias, penalties and temperature do not apply.
    """
    x = np.asarray(logits, dtype=np.float32)
    lse = _log_normaliser(x)
    token_id = _integer("token_id", token_id, 0, x.size)
    top_n = _integer("top_n", top_n, 0, MAX_TOP_LOGPROBS + 1)
    top = []
    if top_n:
        ids = _top_k_ids(x, min(top_n, x.size))
        ids = ids[np.lexsort((ids, -x[ids]))]
        top = [(int(i), float(x[i]) - lse) for i in ids]
    return float(x[token_id]) - lse, top
