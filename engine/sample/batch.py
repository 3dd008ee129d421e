"""The batched sampler: one call samples every row of a step's logits [B, V], each row with its
own request's parameters, penalties, constraint and random generator.

It follows engine.sample.sampler.Sampler exactly (the same tokens, logprobs and random draws), but
does the vocabulary-wide work as [B, V] array operations: the float32 copy and NaN check,
log-softmax normalisers, temperature scaling, one value threshold (from a strided sample of
each row) that finds every sampled row's top-k or first nucleus candidates, a sort of only the
tokens holding top_p for rows whose candidates fall short of it (all of them for flat rows),
then top_p / min_p cuts and the draws over candidate arrays. Bias and penalties stay per row,
in place (a few entries, or one pass over that row's own counts).

Guarantees: a row's token and logprobs depend only on that row's logits and its request's
state, never on the other rows (batch invariance): every reduction runs along one row over the
same elements in the same order as Sampler does (numpy's per-row sums and cumulative sums of a
contiguous row match the 1-D ones), rows whose candidate set is ambiguous (ties at its edge)
are resolved with the per-row rule, and each row draws from its own generator, once. No Python
loop runs over the vocabulary. Refuses: NaN logits (that row's request fails, the others go on).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from colibri.engine.sample.sampler import (
    _TOP_P_CANDIDATES,
    GREEDY_TEMPERATURE,
    Sampler,
    SampleResult,
    _top_indices,
)

# Each thread keeps its [B, V] working arrays between steps: fresh arrays this large come from
# the operating system every step, and faulting their pages in costs more than the arithmetic.
_SCRATCH_MAX_BYTES = 64 << 20
_scratch_local = threading.local()


def _scratch(slot: int, shape: tuple[int, int], dtype: type) -> np.ndarray:
    """An uninitialised array for this thread's `slot`, reused by the next call."""
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_MAX_BYTES:
        return np.empty(shape, dtype)
    pool: dict[int, np.ndarray] = _scratch_local.__dict__.setdefault("pool", {})
    buf = pool.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = pool[slot] = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def _take_rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
    """x's rows at the increasing indices rows: x itself when they are all of them."""
    return x if len(rows) == x.shape[0] else x[rows]


@dataclass
class RowResult:
    """A sampled row, or the error that failed its request."""

    result: SampleResult | None
    error: BaseException | None = None


def _log_softmax_rows(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row; rows without a finite maximum come back as NaN."""
    z = x.astype(np.float64)
    m = np.max(z, axis=1, keepdims=True)
    bad = ~np.isfinite(m[:, 0])
    m[bad] = 0.0
    z -= m
    out = z - np.log(np.sum(np.exp(z), axis=1, keepdims=True))
    out[bad] = np.nan
    return out


def _adjust_rows(logits: np.ndarray, samplers: list[Sampler], histories: list,
                 errors: list[BaseException | None]) -> np.ndarray:
    """Sampler.adjusted_logits for every row: one float32 copy and NaN check for all rows, then
    each row's count update, logit_bias and repetition / presence / frequency penalties (the
    same float32 operations per element as Sampler)."""
    n_rows, vocab = logits.shape
    x = _scratch(0, (n_rows, vocab), np.float32)
    np.copyto(x, logits, casting="unsafe")  # logits.astype(float32)
    nan_rows = np.isnan(x).any(axis=1)
    ok: list[int] = []
    for i, s in enumerate(samplers):
        try:
            if s.vocab_size != vocab:
                raise ValueError(f"logits shape ({vocab},) != ({s.vocab_size},)")
            if nan_rows[i]:
                raise ValueError("logits contain NaN")
            s._ingest(histories[i])
            if s._bias_ids is not None:
                x[i, s._bias_ids] += s._bias_vals
            ok.append(i)
        except Exception as exc:  # noqa: BLE001 - this row's request fails alone
            errors[i] = exc
    # Penalties in place, row by row over each row's own arrays: stacking the rows' counts
    # into [B, V] temporaries measured slower (their pages are faulted in every step).
    for i in ok:
        s, row = samplers[i], x[i]
        if s._seen is not None:
            v = row[s._seen]
            r = np.float32(s.params.repetition_penalty)
            row[s._seen] = np.where(v > 0, v / r, v * r)
        if s._counts is not None:
            row -= np.float32(s.params.frequency_penalty) * s._counts.astype(np.float32)
            row -= np.float32(s.params.presence_penalty) * (s._counts > 0).astype(np.float32)
    return x


def _top_sets(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best ids, best first, ties broken by the lower id (as _top_indices), and
    their values. A threshold from a strided sample of the row (exact partition for the rows it
    leaves short) gives a superset of the k best that holds every token tied with them, so a
    stable sort of that small set orders it exactly like the per-row rule."""
    n, vocab = z.shape
    step = 8
    sub = z[:, ::step]
    rank = 3 * k // (2 * step) + 8  # aim at about 1.5 k tokens above the threshold
    if rank < sub.shape[1]:
        thr = np.partition(sub, sub.shape[1] - rank, axis=1)[:, sub.shape[1] - rank]
        above = z >= thr[:, None]
        short = np.flatnonzero(np.count_nonzero(above, axis=1) < k)
    else:
        thr = np.empty(n)
        above = np.zeros(z.shape, dtype=bool)
        short = np.arange(n)
    if short.size:
        thr[short] = np.partition(z[short], vocab - k, axis=1)[:, vocab - k]
        above[short] = z[short] >= thr[short, None]
    rows, ids = np.nonzero(above)  # row-major: each row's ids ascending
    counts = np.bincount(rows, minlength=n)
    width = int(counts.max())
    start = np.cumsum(counts) - counts
    col = np.arange(rows.shape[0]) - start[rows]
    cand = np.zeros((n, width), dtype=np.int64)
    vals = np.full((n, width), -np.inf)
    cand[rows, col] = ids
    vals[rows, col] = z[rows, ids]
    # A fast (unstable) sort orders the values; only rows with equal values among their first
    # k + 1 need the stable sort, whose order among equals is the ids' (padding sits after
    # each row's real entries, so it stays behind them).
    neg = -vals
    order = np.argsort(neg, axis=1)
    head = np.take_along_axis(neg, order[:, :k + 1], axis=1)
    for r in np.flatnonzero(np.any(head[:, 1:] == head[:, :-1], axis=1)):
        order[r] = np.argsort(neg[r], kind="stable")
    order = order[:, :k]
    return np.take_along_axis(cand, order, axis=1), np.take_along_axis(vals, order, axis=1)


def _order_rows(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """np.argsort(-z, axis=1, kind="stable") (best first, ties to the lower id), where
    z = x.astype(float64) / temperature: one sort of unique int64 keys (x's float32 bits mapped
    to integers of the same order, then the id), much faster than a stable float sort.
    Dividing distinct float32 values by a temperature keeps them distinct unless the result
    overflows; a row where the key order and z disagree takes the stable sort."""
    n, width = x.shape
    bits = (x + np.float32(0.0)).view(np.int32).astype(np.int64)  # -0.0 sorts as 0.0
    bits = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # same order as the floats
    keys = np.sort(-bits * (1 << 32) + np.arange(width), axis=1)
    order = keys & 0xFFFFFFFF
    zs = np.take_along_axis(z, order, axis=1)
    xs = np.take_along_axis(x, order, axis=1)
    bad = np.any((zs[:, 1:] == zs[:, :-1]) & (xs[:, 1:] != xs[:, :-1]), axis=1)
    for r in np.flatnonzero(bad):
        order[r] = np.argsort(-z[r], kind="stable")
    return order


@dataclass
class _Group:
    """Rows that finish alike: candidates [n, L] in the order Sampler scans them."""

    rows: np.ndarray  # positions in the sampled-row arrays
    cand: np.ndarray  # token ids
    vals: np.ndarray  # scaled logits of cand
    first_is_max: bool  # best-first order (else index order over the whole vocabulary)
    nucleus_total: np.ndarray | None  # top_p normaliser over the full vocabulary (no top_k)


def _draw_rows(x: np.ndarray, x_max: np.ndarray,
               samplers: list[Sampler]) -> list[int | BaseException]:
    """Sampler._draw for every row of x [n, V] (adjusted float32 logits, temperature > 0;
    x_max: each row's maximum as float64)."""
    n, vocab = x.shape
    params = [s.params for s in samplers]
    temp = np.array([p.temperature for p in params], dtype=np.float64)
    z = _scratch(1, (n, vocab), np.float64)
    np.divide(x, temp[:, None], out=z)  # x.astype(float64) / temperature
    # dividing by a positive number keeps the order, so the scaled maximum is the maximum
    m = x_max / temp
    out: list[int | BaseException | None] = [None] * n
    fine = np.isfinite(m)
    # rows the vectorised path does not model (a scaled logit overflowed) take the per-row rule
    for r in np.flatnonzero(~fine):
        try:
            out[r] = samplers[r]._draw(x[r])
        except Exception as exc:  # noqa: BLE001
            out[r] = exc
    top_k = np.array([s._top_k if 0 < s._top_k < vocab else 0 for s in samplers])
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params], dtype=np.float64)
    nucleus_only = fine & (top_k == 0) & (top_p < 1.0)
    plain = fine & (top_k == 0) & (top_p >= 1.0)
    n_first = min(_TOP_P_CANDIDATES, vocab)
    groups: list[_Group] = []
    need = np.flatnonzero(fine & ((top_k > 0) | nucleus_only))
    if need.size:
        k_set = int(max(np.max(top_k[need]), n_first if nucleus_only.any() else 0))
        best, bvals = _top_sets(z[need], k_set)
        pos = {int(r): j for j, r in enumerate(need)}
        for k in np.unique(top_k[need][top_k[need] > 0]):
            rows = need[top_k[need] == k]
            sel = [pos[int(r)] for r in rows]
            groups.append(_Group(rows, best[sel, :k], bvals[sel, :k], True, None))
        rows = np.flatnonzero(nucleus_only)
        if rows.size:
            sel = [pos[int(r)] for r in rows]
            groups.extend(_nucleus_groups(x, z, m, rows, best[sel, :n_first],
                                          bvals[sel, :n_first], top_p))
    rows = np.flatnonzero(plain)
    if rows.size:
        groups.append(_Group(rows, np.broadcast_to(np.arange(vocab), (rows.size, vocab)),
                             z[rows], False, None))
    finals = [_finish(g, m[g.rows], top_p[g.rows], min_p[g.rows]) for g in groups]
    # every array is ready: now each row draws once from its own generator
    for g, (cdf, keep) in zip(groups, finals, strict=True):
        u = np.array([samplers[r]._rng.random() for r in g.rows]) * cdf[:, -1]
        j = np.count_nonzero(cdf <= u[:, None], axis=1)  # searchsorted(side="right")
        last = keep.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=1)
        j = np.where(j < keep.shape[1], j, last)
        for r, tok in zip(g.rows, g.cand[np.arange(j.shape[0]), j], strict=True):
            out[r] = int(tok)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def _nucleus_groups(x: np.ndarray, z: np.ndarray, m: np.ndarray, rows: np.ndarray, best: np.ndarray,
                    bvals: np.ndarray, top_p: np.ndarray) -> list[_Group]:
    """Sampler._nucleus's widening for top_p rows without top_k: the first candidate set when it
    holds top_p of the mass, else (one stable full sort of those rows) x16 steps up to all."""
    vocab = z.shape[1]
    e = _scratch(2, (rows.size, vocab), np.float64)
    np.subtract(z if rows.size == z.shape[0] else z[rows], m[rows, None], out=e)
    np.exp(e, out=e)
    total = np.sum(e, axis=1)
    n_first = best.shape[1]
    held = np.sum(np.exp(bvals - m[rows, None]), axis=1) / total >= top_p[rows]
    if n_first == vocab:
        held[:] = True
    groups = [_Group(rows[held], best[held], bvals[held], True, total[held])] if held.any() \
        else []
    short = np.flatnonzero(~held)
    exact: list[int] = []
    first_mass = np.sum(np.exp(bvals - m[rows, None]), axis=1) / total
    for j in short:
        r = rows[j]
        # each next block of n_first tokens holds at most the first block's mass, so a light
        # first block rules out Sampler's x16 set: it sorts everything
        if 16 * first_mass[j] < top_p[r] - _MASS_MARGIN:
            exact.append(int(j))
            continue
        found = _mass_prefix(z[r], e[j], total[j], float(top_p[r]), n_first)
        if found is None:
            exact.append(int(j))
            continue
        ids = found[np.argsort(-z[r, found], kind="stable")]
        groups.append(_Group(rows[j:j + 1], ids[None], z[r, ids][None], True, total[j:j + 1]))
    short = np.asarray(exact, dtype=np.int64)
    if short.size:
        zs = z[rows[short]]
        order = _order_rows(x[rows[short]], zs)
        ovals = np.take_along_axis(zs, order, axis=1)
        k = n_first
        left = np.arange(short.size)
        while left.size:
            k = min(k * 16, vocab)
            if k == vocab:
                ok = np.ones(left.size, dtype=bool)
            else:
                mm = m[rows[short[left]], None]
                ok = (np.sum(np.exp(ovals[left, :k] - mm), axis=1) / total[short[left]]
                      >= top_p[rows[short[left]]])
            done = left[ok]
            if done.size:
                groups.append(_Group(rows[short[done]], order[done, :k], ovals[done, :k], True,
                                     total[short[done]]))
            left = left[~ok]
    return groups


# A prefix holding top_p plus this much of the mass ends the nucleus for certain: the sums in
# any order differ from Sampler's by far less (~1e-12), so every later token's mass-before
# is at least top_p and Sampler keeps none of them.
_MASS_MARGIN = 1e-9


def _mass_prefix(z: np.ndarray, e: np.ndarray, total: float, top_p: float,
                 n_first: int) -> np.ndarray | None:
    """Ids (ascending) of the best tokens down to a value threshold, when they hold more than
    top_p of the mass and fit in Sampler's next candidate set (x16); None otherwise."""
    vocab = z.shape[0]
    limit = min(n_first * 16, vocab)
    ranks = [r for r in (2 * n_first, 4 * n_first, 8 * n_first, 16 * n_first) if r <= limit]
    if not ranks or limit == vocab and ranks[-1] == vocab:
        return None
    kth = np.partition(z, [vocab - r for r in ranks])
    for r in ranks:
        mask = z >= kth[vocab - r]
        if np.count_nonzero(mask) <= limit and \
                np.sum(e, where=mask) / total >= top_p + _MASS_MARGIN:
            return np.flatnonzero(mask)
    return None


def _finish(g: _Group, m: np.ndarray, top_p: np.ndarray,
            min_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cumulative weights each row draws from and which candidates it keeps: the top_p
    cut (Sampler._nucleus), then min_p, as masks over the candidates (a zero weight adds
    nothing to a cumulative sum, so the kept entries' sums equal Sampler's)."""
    n, width = g.vals.shape
    # the scan's maximum: its first entry when best first, the row's maximum otherwise
    mx = g.vals[:, 0] if g.first_is_max else m
    e = np.exp(g.vals - mx[:, None])
    keep = np.ones((n, width), dtype=bool)
    cut = top_p < 1.0
    if cut.any():
        total = g.nucleus_total if g.nucleus_total is not None else np.sum(e, axis=1)
        probs = e / total[:, None]
        before = np.cumsum(probs, axis=1) - probs  # mass of the strictly better tokens
        n_keep = np.maximum(1, np.count_nonzero(before < top_p[:, None], axis=1))
        n_keep = np.where(cut, n_keep, width)
        keep = np.arange(width)[None, :] < n_keep[:, None]
    floor = min_p > 0.0
    if floor.any():
        top = np.max(e, axis=1, where=keep, initial=0.0)
        keep &= ~floor[:, None] | (e >= (min_p * top)[:, None])
    cdf = np.cumsum(np.where(keep, e, 0.0), axis=1)
    return cdf, keep


def sample_rows(logits: np.ndarray, samplers: list[Sampler],
                histories: list[list[int]]) -> list[RowResult]:
    """Sample one token per row. logits: float32 [B, V]; samplers[i] and histories[i] (prompt +
    generated ids) belong to row i. The samplers' penalty counts advance as in Sampler."""
    n_rows = logits.shape[0]
    errors: list[BaseException | None] = [None] * n_rows
    adjusted = _adjust_rows(logits, samplers, histories, errors)
    for i, s in enumerate(samplers):
        constraint = getattr(s.params, "constraint", None)
        if errors[i] is None and constraint is not None:
            try:
                # the row's constraint masks its row in place (disallowed tokens -> -inf)
                constraint.apply(adjusted[i])
            except Exception as exc:  # noqa: BLE001 - this row's request fails alone
                errors[i] = exc
    for i in range(n_rows):
        if errors[i] is not None:
            adjusted[i] = 0.0
    # Sampler's log-softmax, keeping only what is returned: shifted[token] - log(sum(exp)),
    # for the rows that asked for logprobs (the exponentials of a whole row are most of a
    # greedy row's cost); every row's maximum, which a row without a finite one fails on
    mx = np.max(adjusted, axis=1).astype(np.float64)
    bad = ~np.isfinite(mx)
    mx[bad] = 0.0
    for i in range(n_rows):
        if errors[i] is None and bad[i]:
            errors[i] = ValueError("logits have no finite maximum")
    scored = [i for i, s in enumerate(samplers)
              if errors[i] is None and s.params.logprobs is not None]
    lse = np.full(n_rows, np.nan)
    if scored:
        sub = _take_rows(adjusted, scored)
        work = _scratch(2, sub.shape, np.float64)
        np.subtract(sub, mx[scored, None], out=work)  # float64, as Sampler's astype - m
        np.exp(work, out=work)
        lse[scored] = np.log(np.sum(work, axis=1))
    drawn = [i for i, s in enumerate(samplers)
             if errors[i] is None and not s.params.temperature < GREEDY_TEMPERATURE]
    tokens: dict[int, int | BaseException] = {}
    if drawn:
        sub = _take_rows(adjusted, drawn)
        tokens = dict(zip(drawn, _draw_rows(sub, mx[drawn], [samplers[i] for i in drawn]),
                          strict=True))
    out: list[RowResult] = []
    for i, s in enumerate(samplers):
        err = errors[i]
        # greedy: the first maximum, so ties go to the lowest id
        tok = tokens[i] if i in tokens else int(np.argmax(adjusted[i]))
        if isinstance(tok, BaseException):
            err = tok
        if err is not None:
            out.append(RowResult(None, err))
            continue
        assert isinstance(tok, int)
        if s.params.logprobs is None:
            out.append(RowResult(SampleResult(tok)))
            continue
        row = (adjusted[i].astype(np.float64) - mx[i]) - lse[i]
        k = min(s.params.logprobs, row.shape[0])
        idx = _top_indices(row, k) if k > 0 else np.empty(0, dtype=np.int64)
        # a constraint's masked tokens (-inf) have no logprob to report
        top = [(int(j), float(row[j])) for j in idx if row[j] > -np.inf]
        shifted = np.float64(adjusted[i, tok]) - mx[i]
        out.append(RowResult(SampleResult(tok, float(shifted - lse[i]), top)))
    return out


def prompt_logprobs(logits: np.ndarray, targets: np.ndarray, k: int) -> list[tuple[float, list]]:
    """For each row r: logprob of targets[r] under logits[r] and the top-k (id, logprob)."""
    logp = _log_softmax_rows(logits.astype(np.float32, copy=False))
    res = []
    for r in range(logp.shape[0]):
        row = logp[r]
        idx = _top_indices(row, k) if k > 0 else np.empty(0, dtype=np.int64)
        res.append((float(row[int(targets[r])]), [(int(j), float(row[j])) for j in idx]))
    return res
