"""How a synthetic checkpoint's weights compute its designed rule (kipp.synthetic.rule).

The residual stream is split into dedicated dimensions (kipp.synthetic.layout.Dims): a constant
BIAS; CODE, where a live token's embedding is a row of a Hadamard matrix (exactly orthogonal
codes); NOISE, where the other tokens' embeddings (one direction per cluster) and every random
weight's output live; and channels PREV, SWITCH, SIGMA, SIGMA2 that only the circuit writes.
The first layer measures the attention softmax's temperature (attention_tensor, _first_mlp);
the last layer fetches t_{p-2}'s code and its MLP writes the designed token (_last_mlp). The
logits stay peaked, so rounding never flips an argmax, while a fault in attention, RoPE, the
mask, the KV cache or its block table changes greedy output (tests/test_synthetic.py plants
each). Random heads and units write only NOISE, so the random part still moves every logit.
The temperature measurement is a difference of two heads' outputs in the first layer's o_proj,
e^-4 of either: large enough that rounding that projection's input to int8 per block or to bf16
(as the fast CPU and GPU dots do) moves it by a few percent, small enough that a 10% error in
the attention scale moves it by a third; the last MLP's window between the two is narrow.
Structured weights are quantization-friendly: each 32-weight block of a structured row holds
one value or values of one magnitude; o_proj's SWITCH entries are +-15/16 (exact in Q4_0, Q4_1,
and negated exactly in Q8_0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kipp.formats.registry import HEAD_DIM, KV_HEADS, Checkpoint
from kipp.synthetic.layout import Dims, Roles
from kipp.synthetic.positional import positional_qk, profile_scores, rope_profiles
from kipp.synthetic.rule import (
    N_LIVE,
    cluster_fallback,
    fallback_successor,
    live_token_ids,
    rng,
    successor,
    token_clusters,
)

FIRST_PADDING_ID = 151_669  # embedding rows from here on are padding no text maps to
BIAS_RATIO = 2.0  # the BIAS dimension / a token embedding's norm
CHANNEL = 0.5  # norm of PREV and SWITCH (as M2) writes / a token embedding's norm
SIGMA_CHANNEL = 0.1  # SIGMA, SIGMA2 / a token embedding's norm: small, so that their rounding
                     # noise barely moves any RMSNorm's scale
RESIDUAL_NOISE = 0.4  # norm of all random writes / a token embedding's norm
MLP_NOISE_SHARE = 0.7  # of that energy, the random MLP units' part (SiLU errors show there)
MAIN_WRITE = 4.0  # main write / token embedding norm (outvotes the input's own row)
FALLBACK_WRITE = 2.0  # fallback write / token embedding norm
MAIN_LOGIT = 16.0  # the designed next token's logit when the main rule fires
NOISE_LOGIT_GAIN = 0.2  # final-norm weight on NOISE dims / on CODE dims
NORM_NOISE = 0.1  # RMSNorm weights are (gain) * (1 + N(0, NORM_NOISE)) on token dimensions
QK_NORM_GAIN = 2.0  # q/k RMSNorm gain of random layers: sharp attention
STRUCTURED_QK_GAIN = 3.0  # q/k RMSNorm gain of the first and last layers (the profiles need it)
NONLIVE_NOISE = 0.1  # a non-live token's own direction added to its cluster's (ties broken)
SWITCH_GAIN = 0.02  # first-MLP gate input a x at nominal SWITCH: silu is linear there
C_OUT = 15 / 16  # o_proj entries of the first layer's channels: exact in every scheme
# The main pairs: gate = A m + B s - THETA with m the SWITCH match and s SIGMA2, each 1 at its
# designed value. Past the plateau (g >= PLATEAU + 6) for m >= 0.98 and s in [0.9, 1.3]; off
# (g <= -6) for s <= 0.82 (attention scale x1.1: s = 0.67) or m <= 0.05 (another token). Six
# units past either side leave a pair's write within 0.6% of its own, and the narrow window
# leaves room for activations rounded to int8 or bf16 (they move s by up to 0.08).
PLATEAU = 2.0  # a plateau pair's output (see _plateau)
AND_A, AND_B = 110.0, 205.0
AND_THETA = 0.98 * AND_A + 0.9 * AND_B - PLATEAU - 6.0
# Fallback pairs: g = A m - THETA with m the match of the current token's code: past the
# plateau (g >= PLATEAU + 8) for m >= 0.8, off (g <= -8) for m <= 0.2.
FALLBACK_A, FALLBACK_THETA = 30.0, 14.0


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n x n Hadamard matrix (n a power of two): orthogonal rows of +-1."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@lru_cache(maxsize=None)
def live_codes(entry: Checkpoint, name: str) -> np.ndarray:
    """[N_LIVE, N_LIVE] +-1 codes of the live tokens in a token matrix: Hadamard rows with
    seeded row order and column signs (still exactly orthogonal)."""
    r = rng(entry, name + "/codes")
    h = hadamard(N_LIVE)[r.permutation(N_LIVE)]
    out = h * r.choice([-1.0, 1.0], N_LIVE)[None, :]
    out.flags.writeable = False
    return out


@lru_cache(maxsize=None)
def cluster_basis(entry: Checkpoint, name: str) -> np.ndarray:
    """[len(noise), clusters] orthonormal NOISE directions, one per cluster."""
    dims = Dims(entry.hidden)
    g = rng(entry, name + "/cluster-basis").standard_normal((len(dims.noise), dims.clusters))
    q, _ = np.linalg.qr(g)
    return q


def token_norm(entry: Checkpoint) -> float:
    """The norm of every token embedding's token part (BIAS aside): sqrt(hidden)."""
    return math.sqrt(entry.hidden)


@lru_cache(maxsize=None)
def _silu_square_mean(tau: float) -> float:
    """E[silu(g)^2] for g ~ N(0, tau^2), by Gauss-Hermite quadrature."""
    z, w = np.polynomial.hermite_e.hermegauss(64)
    g = tau * z
    return float(np.sum(w * (g / (1 + np.exp(-g))) ** 2) / math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class Scales:
    """Every magnitude of one entry's circuit, derived from its shapes."""

    token: float  # N: norm of a token embedding's token part
    bias: float  # value of the BIAS dimension in every embedding row
    projection: float  # std of random q/k/v/gate/up weights (the registry's init_std)
    attention_write: float  # std of random o_proj weights (writing NOISE only)
    mlp_write: float  # std of random down_proj weights (writing NOISE only)
    rms: dict  # nominal RMS of the residual at each RMSNorm the circuit relies on
    value: float  # first layer: value = this * normalized CODE (PREV gets CHANNEL * N)
    switch_gain: float  # first MLP gate weight on SWITCH
    sigma_out: float  # first MLP down weight into SIGMA
    transport: float  # last layer: value = this * normalized PREV / SIGMA
    final_code: float  # mean final-norm weight on CODE dims
    prev_weight: float  # SCALE's designed attention weight on the previous position


@lru_cache(maxsize=None)
def scales(entry: Checkpoint) -> Scales:
    """The circuit's magnitudes for `entry` (derivations beside each line)."""
    d, n = entry.hidden, N_LIVE
    token = token_norm(entry)
    e_bias, e_tok = (BIAS_RATIO * token) ** 2, token ** 2
    e_ch, e_sigma = (CHANNEL * token) ** 2, (SIGMA_CHANNEL * token) ** 2
    e_noise = (RESIDUAL_NOISE * token) ** 2
    rms = {
        "first_attention": math.sqrt((e_bias + e_tok) / d),
        "first_mlp": math.sqrt((e_bias + e_tok + e_ch + e_noise) / d),  # PREV written
        "last_attention": math.sqrt((e_bias + e_tok + e_ch + e_sigma + e_noise) / d),
        "last_mlp": math.sqrt((e_bias + e_tok + 2 * e_ch + 2 * e_sigma + e_noise) / d),
    }
    rms["final"] = math.sqrt(rms["last_mlp"] ** 2
                             + (MAIN_WRITE ** 2 + FALLBACK_WRITE ** 2) * e_tok / d)
    gap = rope_profiles(entry.rope_theta)["scale"]
    g = float(profile_scores(gap, [0], entry.rope_theta)[0]
              - profile_scores(gap, [-1], entry.rope_theta)[0])
    prev_weight = math.exp(-g) / (1 + math.exp(-g))
    # PREV = C_OUT * value * (CODE / rms): |CODE| = N, so |PREV| = CHANNEL * N needs:
    value = CHANNEL * rms["first_attention"] / C_OUT
    # SWITCH[u] <= prev_weight * 2 |PREV| / sqrt(n); its gate input is SWITCH_GAIN there.
    switch_gain = SWITCH_GAIN * rms["first_mlp"] * math.sqrt(n) / (
        2 * prev_weight * CHANNEL * token)
    # SIGMA = sigma_out * sum_u silu(a SWITCH_u / rms) PREV_u / rms ~ sigma_out (a / 2)
    # prev_weight |PREV|^2 / rms^2; its designed value is SIGMA_CHANNEL * N.
    sigma_out = SIGMA_CHANNEL * token * rms["first_mlp"] ** 2 / (
        switch_gain / 2 * prev_weight * (CHANNEL * token) ** 2)
    transport = rms["last_attention"]  # copies PREV and SIGMA at their own magnitude
    final_code = MAIN_LOGIT * rms["final"] / (MAIN_WRITE * token ** 2)
    attention_write, mlp_write = _write_scales(entry, e_noise)
    return Scales(token, BIAS_RATIO * token, entry.synthetic.init_std, attention_write,
                  mlp_write, rms, value, switch_gain, sigma_out, transport, final_code,
                  prev_weight)


def _write_scales(entry: Checkpoint, e_noise: float) -> tuple[float, float]:
    """Stds of random o_proj and down_proj entries (they write NOISE only): all random writes
    add up to e_noise, MLP_NOISE_SHARE of it from the MLP units. A random projection's output
    has variance tau^2 = init_std^2 * hidden (its input is RMS-normalised)."""
    tau2 = entry.synthetic.init_std ** 2 * entry.hidden
    roles = Roles(entry.query_heads // KV_HEADS)
    heads = units = 0
    for layer in range(entry.layers):
        first, last = layer == 0, layer == entry.layers - 1
        heads += entry.query_heads - (len(roles.structured_heads(first)) if first or last
                                      else 0)
        units += entry.intermediate - (N_LIVE if first else structured_units(entry) if last
                                       else 0)
    d_noise = len(Dims(entry.hidden).noise)
    attention = heads * HEAD_DIM * tau2 * 0.8  # values keep their BIAS-driven offset
    mlp = units * tau2 * _silu_square_mean(math.sqrt(tau2))
    return (math.sqrt((1 - MLP_NOISE_SHARE) * e_noise / (d_noise * attention)),
            math.sqrt(MLP_NOISE_SHARE * e_noise / (d_noise * mlp)))


def _gaussian(entry: Checkpoint, name: str, shape, std: float) -> np.ndarray:
    out = rng(entry, name).standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def norm_weights(entry: Checkpoint, name: str, kind: str) -> np.ndarray:
    """An RMSNorm weight vector in float32 (already BF16-exact).

    Token dimensions (CODE, NOISE) get 1 + N(0, NORM_NOISE): near 1, yet each one matters.
    The circuit's own dimensions get exactly 1 (0 in the final norm: they never reach a
    logit). q/k norms are a gain times 1 + noise; the positional heads compensate it."""
    dims = Dims(entry.hidden)
    layer = _layer_of(name)
    if kind == "qk_norm":
        gain = STRUCTURED_QK_GAIN if layer in (0, entry.layers - 1) else QK_NORM_GAIN
        return _bf16(gain * (1 + _gaussian(entry, name, (HEAD_DIM,), NORM_NOISE)))
    noise = 1 + _gaussian(entry, name, (entry.hidden,), NORM_NOISE)
    if kind == "norm":
        out = np.ones(entry.hidden, np.float32)
        token = np.r_[dims.code, dims.noise]
        out[token] = noise[token]
        return _bf16(out)
    out = np.zeros(entry.hidden, np.float32)  # final norm
    code = scales(entry).final_code
    out[dims.code] = code * noise[dims.code]
    out[dims.noise] = code * NOISE_LOGIT_GAIN * noise[dims.noise]
    return _bf16(out)


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1


def _layer_name(n: int, suffix: str) -> str:
    return f"model.layers.{n}.{suffix}"


def token_rows(entry: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the embedding or lm_head, float32.

    Live rows: N / sqrt(N_LIVE) times the token's Hadamard code in CODE. Other non-padding
    rows: N times their cluster's NOISE direction plus a little of their own. The embedding
    also carries the BIAS value; padding rows are zero."""
    dims = Dims(entry.hidden)
    s = scales(entry)
    out = np.zeros((stop - start, entry.hidden), np.float32)
    clusters = token_clusters(entry, name)[start:stop]
    basis = cluster_basis(entry, name).astype(np.float32)  # [noise dims, clusters]
    own = rng(entry, f"{name}/rows-{start}").standard_normal((stop - start, len(dims.noise)),
                                                             dtype=np.float32)
    noise = basis[:, clusters].T + own * np.float32(NONLIVE_NOISE / math.sqrt(len(dims.noise)))
    noise *= np.float32(s.token) / np.linalg.norm(noise, axis=1, keepdims=True)
    out[:, dims.noise] = noise
    ids = np.asarray(live_token_ids(entry))
    inside = (ids >= start) & (ids < stop)
    codes = live_codes(entry, name)[inside] * (s.token / math.sqrt(N_LIVE))
    rows = ids[inside] - start
    out[rows] = 0.0
    out[rows[:, None], dims.code[None, :]] = codes
    if name == "model.embed_tokens.weight":
        out[:, dims.bias] = s.bias
    out[max(FIRST_PADDING_ID, start) - start:] = 0.0
    return out


def output_codes(entry: Checkpoint) -> np.ndarray:
    """[N_LIVE, N_LIVE] unit output directions (in CODE) of the live tokens' output rows."""
    name = "model.embed_tokens.weight" if entry.tied else "lm_head.weight"
    return live_codes(entry, name) / math.sqrt(N_LIVE)


def _random_write(entry: Checkpoint, name: str, shape, std: float) -> np.ndarray:
    """o_proj / down_proj with random N(0, std^2) entries on the NOISE rows only."""
    out = np.zeros(shape, np.float32)
    noise = Dims(entry.hidden).noise
    out[noise] = _gaussian(entry, name, (len(noise), shape[1]), std)
    return out


def _positional(entry: Checkpoint, layer: int):
    """{kv head: (k_pre, {query head: q_pre})} of the positional heads of `layer`."""
    roles = Roles(entry.query_heads // KV_HEADS)
    p = rope_profiles(entry.rope_theta)
    q_norm = norm_weights(entry, _layer_name(layer, "self_attn.q_norm.weight"), "qk_norm")
    k_norm = norm_weights(entry, _layer_name(layer, "self_attn.k_norm.weight"), "qk_norm")
    if layer == 0:
        plan = {0: {roles.self_head: "self", roles.scale_head: "scale"},
                1: {roles.prev_head: "prev"}}
    else:
        plan = {0: {roles.transport_head: "prev"}}
    out = {}
    for kv, heads in plan.items():
        k_pre, q_pres = positional_qk([p[kind] for kind in heads.values()], q_norm, k_norm)
        out[kv] = (k_pre, dict(zip(heads, q_pres)))
    return out


def _random_part(entry: Checkpoint, name: str, shape, write_std: float | None) -> np.ndarray:
    """A projection's random part: a write into NOISE only (o_proj, down_proj: `write_std`), or
    a read of N(0, init_std^2) weights (the others: `write_std` None)."""
    if write_std is not None:
        return _random_write(entry, name, shape, write_std)
    return _gaussian(entry, name, shape, entry.synthetic.init_std)


def attention_tensor(entry: Checkpoint, name: str, shape, kind: str) -> np.ndarray:
    """q/k/v/o_proj of a layer, float32: random, with the circuit's heads in the first and
    last layer (kipp.synthetic.positional's profiles).

    First layer: SELF (own position), SCALE (own position, the previous one exactly 4 below:
    weight w = e^-4 / (1 + e^-4) there) and PREV (previous position) copy CODE; PREV writes the
    previous token's code to PREV, SCALE minus SELF writes w (previous code - own code) to
    SWITCH: a measurement of the softmax's temperature. Last layer: a PREV head copies the previous
    position's PREV (the code of t_{p-2}) to SWITCH and its SIGMA to SIGMA2."""
    layer = _layer_of(name)
    first, last = layer == 0, layer == entry.layers - 1
    out = _random_part(entry, name, shape, scales(entry).attention_write if kind == "o" else None)
    if not (first or last):
        return out
    dims, s = Dims(entry.hidden), scales(entry)
    n, rows = N_LIVE, np.arange(HEAD_DIM)
    positional = _positional(entry, layer)
    roles = Roles(entry.query_heads // KV_HEADS)
    if kind in ("q", "k"):
        _damp_random_heads(entry, out, kind, positional, first)
        for kv, (k_pre, queries) in positional.items():
            for head, vector in ([(kv, k_pre)] if kind == "k" else queries.items()):
                out[head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0.0
                out[head * HEAD_DIM + rows, dims.bias] = vector / 16
    elif kind == "v":
        for kv in positional:
            out[kv * HEAD_DIM:(kv + 1) * HEAD_DIM] = 0.0
            if first:  # values copy CODE
                out[kv * HEAD_DIM + np.arange(n), dims.code] = s.value
            else:  # the transport head copies PREV and SIGMA
                out[kv * HEAD_DIM + np.arange(n), dims.prev] = s.transport
                out[kv * HEAD_DIM + n, dims.sigma] = s.transport
    else:  # o: the circuit's heads write only their channels
        for head in roles.structured_heads(first):
            out[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0.0
        col = np.arange(n)
        if first:
            out[dims.switch, roles.scale_head * HEAD_DIM + col] = C_OUT
            out[dims.switch, roles.self_head * HEAD_DIM + col] = -C_OUT
            out[dims.prev, roles.prev_head * HEAD_DIM + col] = C_OUT
        else:
            out[dims.switch, roles.transport_head * HEAD_DIM + col] = 1.0
            out[dims.sigma2, roles.transport_head * HEAD_DIM + n] = 1.0
    return out


def _damp_random_heads(entry: Checkpoint, out: np.ndarray, kind: str, positional, first: bool):
    """The random heads of the first and last layer get the positional heads' q/k norm gain
    (STRUCTURED_QK_GAIN); to keep them as sharp as the other layers' (QK_NORM_GAIN), part of
    each random query (key) is a constant in RoPE pair 62 (63), where the keys (queries) are 0:
    it takes RMSNorm's share without adding to any score."""
    heads = (range(entry.query_heads) if kind == "q" else range(KV_HEADS))
    skip = ({h for _, queries in positional.values() for h in queries} if kind == "q"
            else set(positional))
    keep = (QK_NORM_GAIN / STRUCTURED_QK_GAIN) ** 2  # random share of each vector's energy
    s = scales(entry)
    tau = entry.synthetic.init_std * math.sqrt(entry.hidden)  # a random row's output std
    dump = tau * math.sqrt((1 / keep - 1) * (HEAD_DIM - 4))
    bias = s.bias / s.rms["first_attention" if first else "last_attention"]  # after RMSNorm
    half = HEAD_DIM // 2
    pair = half - 2 if kind == "q" else half - 1
    for head in heads:
        if head in skip:
            continue
        rows = head * HEAD_DIM + np.array([half - 2, half - 1, HEAD_DIM - 2, HEAD_DIM - 1])
        out[rows] = 0.0
        out[head * HEAD_DIM + pair, Dims(entry.hidden).bias] = dump / bias


def mlp_tensor(entry: Checkpoint, name: str, shape, kind: str) -> np.ndarray:
    """gate/up/down_proj of a layer, float32: random units writing NOISE, with the circuit's
    units in the first (SWITCH x PREV -> SIGMA) and last (AND pairs, fallbacks) layer."""
    layer = _layer_of(name)
    first, last = layer == 0, layer == entry.layers - 1
    out = _random_part(entry, name, shape, scales(entry).mlp_write if kind == "down" else None)
    if first:
        _first_mlp(entry, out, kind)
    elif last:
        _last_mlp(entry, out, kind)
    return out


def _first_mlp(entry: Checkpoint, out: np.ndarray, kind: str) -> None:
    """SWITCH times PREV dimension by dimension (silu(a x) * y ~ a x y / 2 for small a x),
    summed into SIGMA: w |code|^2 (w about e^-4) when the previous token is live and differs
    from this one, 0 otherwise. An attention scale off by 10% moves e^-4 to e^-4.4: SIGMA drops
    to 67%."""
    dims, s, u = Dims(entry.hidden), scales(entry), np.arange(N_LIVE)
    if kind == "down":
        out[:, u] = 0.0
        out[dims.sigma, u] = s.sigma_out
        return
    out[u] = 0.0
    if kind == "gate":
        out[u, dims.switch] = s.switch_gain
    else:
        out[u, dims.prev] = 1.0


def _last_units(entry: Checkpoint) -> dict[str, tuple[int, int]]:
    """Unit blocks of the last MLP: name -> (first unit, count). Each block is a run of "plus"
    units followed by as many "minus" units (see _plateau)."""
    n, k = N_LIVE, Dims(entry.hidden).clusters
    return {"main": (0, n), "live": (2 * n, n), "cluster": (4 * n, k)}


def structured_units(entry: Checkpoint) -> int:
    """Units of the last MLP the circuit uses: main, live and cluster fallback pairs."""
    return 4 * N_LIVE + 2 * Dims(entry.hidden).clusters


def _plateau(out, kind, first, count, reads, gate_rows, theta, bias, write, targets):
    """One block of plateau pairs: unit i (plus) and unit count + i (minus) share a gate
    g_i = reads(gate_rows) - theta, the minus one shifted by PLATEAU: once g >= PLATEAU + 8
    their difference silu(g) - silu(g - PLATEAU) is PLATEAU to 3e-4, so the write (down
    columns +-write / PLATEAU along `targets`, unit vectors in CODE) does not depend on how far
    past its threshold the gate is."""
    plus, minus = first + np.arange(count), first + count + np.arange(count)
    # The two thresholds as stored (BF16): their difference is the plateau actually built.
    thresholds = _bf16(np.array([-theta, -(theta + PLATEAU)]) / bias)
    if kind == "gate":
        for rows, threshold in ((plus, thresholds[0]), (minus, thresholds[1])):
            out[np.ix_(rows, reads)] = gate_rows
            out[rows, Dims.bias] = threshold
    elif kind == "down":
        height = float(thresholds[0] - thresholds[1]) * bias
        out[np.ix_(Dims(out.shape[0]).code, plus)] = write / height * targets.T
        out[np.ix_(Dims(out.shape[0]).code, minus)] = -write / height * targets.T


def _last_mlp(entry: Checkpoint, out: np.ndarray, kind: str) -> None:
    """Per live token j, a plateau pair (_plateau) that fires when SWITCH matches j's code AND
    SIGMA2 is near its designed value writes pi(j)'s output code, exactly whatever the noise;
    one weaker pair per live token and per cluster writes the fallback."""
    dims, s = Dims(entry.hidden), scales(entry)
    units = np.arange(structured_units(entry))
    rms = s.rms["last_mlp"]
    bias = s.bias / rms  # BIAS after the last MLP's RMSNorm (weight 1)
    if kind == "up":
        out[units] = 0.0
        out[units, dims.bias] = 1 / bias  # up = 1 for every circuit unit
        return
    if kind == "gate":
        out[units] = 0.0
    else:  # down
        out[:, units] = 0.0
    codes_out = output_codes(entry)  # unit directions
    codes_in = live_codes(entry, "model.embed_tokens.weight")
    blocks = _last_units(entry)
    # Main: SWITCH holds t_{p-2}'s code through the first layer's norm weights; SIGMA2 the
    # temperature measurement. gate = A m + B s - THETA (AND_* constants).
    first_norm = norm_weights(entry, _layer_name(0, "input_layernorm.weight"), "norm")
    key = _unit_rows(codes_in * first_norm[dims.code])
    m_ref, s_ref = CHANNEL * s.token / rms, SIGMA_CHANNEL * s.token / rms
    rows = np.hstack([AND_A / m_ref * key, np.full((N_LIVE, 1), AND_B / s_ref)])
    _plateau(out, kind, *blocks["main"], np.r_[dims.switch, dims.sigma2], rows, AND_THETA,
             bias, MAIN_WRITE * s.token, codes_out[successor(entry)])
    # Live fallback: CODE holds t_p's own code times this norm's weights.
    last_norm = norm_weights(entry, _layer_name(entry.layers - 1,
                                                "post_attention_layernorm.weight"), "norm")
    weighted = codes_in * last_norm[dims.code]
    m_ref = s.token / math.sqrt(N_LIVE) * np.linalg.norm(weighted, axis=1, keepdims=True) / rms
    _plateau(out, kind, *blocks["live"], dims.code, FALLBACK_A * _unit_rows(weighted) / m_ref,
             FALLBACK_THETA, bias, FALLBACK_WRITE * s.token,
             codes_out[fallback_successor(entry)])
    # Cluster fallback: NOISE holds the cluster's direction (times N) times the weights.
    weighted = cluster_basis(entry, "model.embed_tokens.weight").T * last_norm[dims.noise]
    m_ref = s.token * np.linalg.norm(weighted, axis=1, keepdims=True) / rms
    _plateau(out, kind, *blocks["cluster"], dims.noise,
             FALLBACK_A * _unit_rows(weighted) / m_ref, FALLBACK_THETA, bias,
             FALLBACK_WRITE * s.token, codes_out[cluster_fallback(entry)])


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)
