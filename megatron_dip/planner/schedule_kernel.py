"""The list scheduler's inner loop, compiled (numba): flat arrays in, node order and times out.

This is `list_scheduler`'s dual-queue rule step for step (see that module's docstring); it
exists because the search calls the scheduler hundreds of times per batch and an interpreted
loop over ~10^4 nodes costs tens of milliseconds. The arithmetic is IEEE double precision as in
Python (same additions, comparisons and maxima in the same order), so the node order and every
time are bit-identical to an interpreted run; activation bytes are summed as doubles, exact for
integers below 2**53.

Inputs, for S stages on P ranks (node 2k: forward of stage k; 2k+1: its backward):
  rank[S], fwd_time[S], bwd_time[S], act[S], has_backward[S] (0/1), prank[S] (priority ranks),
  succ_ptr[2S+1], succ_node[E], succ_delay[E] (CSR successor lists), npred[2S],
  limit[P] (+inf: none), fixed[S] (forward nodes of each rank in fixed order, rank-major),
  fixed_ptr[P+1] and use_fixed (fill_bubbles=False), wgt_time[S] (seconds of a split
  backward's weight-gradient half W; 0: the backward is not split), wgt_act[S] (bytes held from
  a split B to its W, instead of act), overshoot, and
  expect_ptr[P+1], expect_t[...] (per rank, when its k-th forward or backward was ready in a
  previous run; empty: unknown).
Output: status (0 ok, 1 stalled), executed nodes in order, start[3S], end[3S], makespan,
peak[P], overcommitted, ready_time[2S] (when each F/B had all its inputs).

Split backwards (Zero-Bubble's B/W, `wgt_time[k] > 0`): node 2k+1 is then stage k's B (its
`bwd_time` is B alone) and node 2S+k its W. A finished B queues its W on its rank; the stage's
activations held drop to what the W needs (`wgt_act`) until the W. A rank runs its oldest
queued W (ZB-H1's rule) where it would otherwise idle: a forward held back by the memory limit, a gap before its next ready node
that the W fits (`overshoot`: the share of the W that may overrun the gap), or, with nothing
ready, a gap before the time its next node was ready in a previous run (`expect_t`), so that a W
does not delay the B chain of the drain; when every rank waits, the W that can start first. So
the W fill bubbles, and memory held by deferred W throttles new forwards instead of exceeding
the limit.

Data-parallel gradient reductions (`red_grp[S]`: a stage's reduction group, its chunk, -1: none;
`red_count[G]`: the group's stages with a backward; `red_time[G]`: seconds of its reduction):
a group's reduction starts when its last W (or fused backward) ends, after the rank's previous
reduction (one channel per rank beside the compute, as `schedule.engine` runs `ReduceGrads`),
and the makespan includes it. The W are not deferred past the reduction's deadline (`deadline`,
the compute's end in a previous run; +inf: unknown): once a chunk's last B is done, a rank runs
its queued W (oldest first, up to that chunk's last) instead of a forward or backward, or
instead of waiting, whenever deferring them by that much would make the chunk's reduction end
after the deadline, unless the rank's reduction channel is busy until later anyway.
"""

from __future__ import annotations

import logging

import numpy as np

try:
    from numba import njit

    COMPILED = True
except ImportError:  # the same code, interpreted: identical results, ~100x slower per node
    COMPILED = False
    logging.getLogger(__name__).warning(
        "numba is not installed: the planner's list scheduler runs interpreted (pip install numba)"
    )

    def njit(*args, **kwargs):
        """Stand-in for numba.njit: the function itself."""
        if args and callable(args[0]):
            return args[0]
        return lambda fn: fn


INF = np.inf


@njit(cache=True)
def _choose(r, strict, rdy_f, nf, rdy_b, nb, base, ready_time, prank, act, mem, limit, free_at,
            last_fwd, want):  # fmt: skip
    """Rank r's next node and its start, or (-1, 0.0): the rule of `_rank_choice`."""
    lo = base[r]
    tmin = INF
    found = False
    for i in range(lo, lo + nf[r]):
        node = rdy_f[i]
        k = node >> 1
        if strict and not mem[r] + act[k] <= limit[r]:
            continue
        if want[r] not in (-2, node):
            continue
        found = True
        tmin = min(tmin, ready_time[node])
    for i in range(lo, lo + nb[r]):
        found = True
        tmin = min(tmin, ready_time[rdy_b[i]])
    if not found:
        return -1, 0.0
    t0 = max(free_at[r], tmin)
    best_f = _best(rdy_f, lo, nf[r], t0, True, strict, ready_time, prank, act, mem[r], limit[r],
                   want[r])  # fmt: skip
    best_b = _best(rdy_b, lo, nb[r], t0, False, False, ready_time, prank, act, 0.0, INF, -2)
    if best_f >= 0 and best_b >= 0:
        return (best_b if last_fwd[r] else best_f), t0
    return (best_f if best_f >= 0 else best_b), t0


@njit(cache=True)
def _choose_weight(r, node, t0, wq, wq_head, wq_tail, wgt_time, free_at, overshoot, num_stages,
                   memory_bound, expect, node_time, slack):  # fmt: skip
    """Rank r's oldest queued W instead of its F/B choice `node` at `t0` (lasting `node_time`),
    or -1 (wait), or the choice itself: the W runs where a forward is held back by memory
    (`memory_bound`), in the gap before `t0` if it fits (overrunning by at most `overshoot` of
    it), and, with nothing ready, if it fits before `expect` (when the rank's next F/B was ready
    in the previous run; +inf: unknown); and wherever deferring it would delay the queued W
    more than `slack` seconds (`_weight_slack`: a reduction's deadline)."""
    if wq_head[r] == wq_tail[r]:
        return node, t0
    k = wq[wq_head[r]]
    need = wgt_time[k] * (1.0 - overshoot)
    if node < 0:
        if memory_bound or need <= expect - free_at[r] or expect - free_at[r] > slack:
            return 2 * num_stages + k, free_at[r]
        return -1, 0.0
    if need <= t0 - free_at[r] or t0 - free_at[r] + node_time > slack:
        return 2 * num_stages + k, free_at[r]
    return node, t0


@njit(cache=True)
def _weight_slack(r, wq_head, wq_cum, base, urg_pos, urg_red, free_at, red_free, deadline):
    """Seconds rank r may defer its queued W and still have the reduction of the chunk whose last
    W sits at queue slot `urg_pos[r]` end by `deadline` (or by when its reduction channel is
    free anyway); +inf where no such W is queued."""
    if urg_pos[r] < wq_head[r]:
        return INF
    before = wq_cum[wq_head[r] - 1] if wq_head[r] > base[r] else 0.0
    work = wq_cum[urg_pos[r]] - before
    return max(red_free[r], deadline - urg_red[r]) - free_at[r] - work


@njit(cache=True)
def _any_weight(wq, wq_head, wq_tail, free_at, num_stages):
    """(rank, W node, start) of the queued W that can start first, or rank -1: what runs when
    every rank waits (for messages, or for a W to fit)."""
    best = -1
    for r in range(free_at.shape[0]):
        if wq_head[r] < wq_tail[r] and (best < 0 or free_at[r] < free_at[best]):
            best = r
    if best < 0:
        return -1, -1, 0.0
    return best, 2 * num_stages + wq[wq_head[best]], free_at[best]


@njit(cache=True)
def _best(entries, lo, count, t0, forward, strict, ready_time, prank, act, mem, limit, want):
    """The entry with the lowest (priority, ready time, node) among those ready by t0."""
    best = -1
    for i in range(lo, lo + count):
        node = entries[i]
        t = ready_time[node]
        if not t <= t0:
            continue
        k = node >> 1
        if forward:
            if strict and not mem + act[k] <= limit:
                continue
            if want not in (-2, node):
                continue
        if best < 0:
            best = node
            continue
        pb, pn = prank[best >> 1], prank[k]
        tb = ready_time[best]
        if pn < pb or (pn == pb and (t < tb or (t == tb and node < best))):
            best = node
    return best


# One loop over flat state on purpose: split into helpers it would pass ~30 arrays around.
@njit(cache=True)
def run_schedule(rank, fwd_time, bwd_time, act, has_backward, prank, succ_ptr, succ_node,  # noqa: PLR0912, PLR0915
                 succ_delay, npred0, limit, fixed, fixed_ptr, use_fixed, wgt_time, wgt_act,
                 overshoot, expect_ptr, expect_t, red_grp, red_count, red_time,
                 deadline):  # fmt: skip
    """Schedule every node; see the module docstring for the arrays."""
    num_stages, num_ranks = rank.shape[0], limit.shape[0]
    # Ready forwards and backwards of rank r live in [base[r], base[r] + nf[r]) / + nb[r].
    base = np.zeros(num_ranks + 1, dtype=np.int64)
    for k in range(num_stages):
        base[rank[k] + 1] += 1
    for r in range(num_ranks):
        base[r + 1] += base[r]
    rdy_f = np.zeros(num_stages, dtype=np.int64)
    rdy_b = np.zeros(num_stages, dtype=np.int64)
    nf = np.zeros(num_ranks, dtype=np.int64)
    nb = np.zeros(num_ranks, dtype=np.int64)
    slot = np.full(2 * num_stages, -1, dtype=np.int64)  # where a ready node sits
    npred = npred0.copy()
    ready_time = np.zeros(2 * num_stages)
    start = np.zeros(3 * num_stages)
    end = np.zeros(3 * num_stages)
    # Queued W of rank r: wq[wq_head[r]:wq_tail[r]] (stage numbers, oldest first).
    wq = np.zeros(num_stages, dtype=np.int64)
    wq_head = base[:num_ranks].copy()
    wq_tail = base[:num_ranks].copy()
    wq_cum = np.zeros(num_stages)  # per rank's slots: seconds of its W queued so far
    # Reductions: gradient-finishing nodes (W or fused B) and B left per group, the queue slot
    # of each group's last W, per rank the slot of the latest queued last W of a finished chunk
    # (and its reduction's seconds), and when its reduction channel is free.
    red_left = red_count.copy()
    b_left = red_count.copy()
    grp_last = np.full(red_count.shape[0], -1, dtype=np.int64)
    urg_pos = np.full(num_ranks, -1, dtype=np.int64)
    urg_red = np.zeros(num_ranks)
    red_free = np.zeros(num_ranks)
    done_fb = np.zeros(num_ranks, dtype=np.int64)  # F/B run per rank (index into expect_t)
    free_at = np.zeros(num_ranks)
    last_fwd = np.zeros(num_ranks, dtype=np.bool_)
    mem = np.zeros(num_ranks)
    peak = np.zeros(num_ranks)
    next_fixed = fixed_ptr[:num_ranks].copy()
    want = np.full(num_ranks, -2, dtype=np.int64)  # -2: any forward; else the only one allowed
    for k in range(num_stages):
        if npred[2 * k] == 0:
            _push(2 * k, rank[k], rdy_f, nf, base, slot)
    total = num_stages + np.sum(has_backward) + np.sum((wgt_time > 0) & (has_backward > 0))
    order = np.zeros(total, dtype=np.int64)
    cached_node = np.full(num_ranks, -1, dtype=np.int64)
    cached_t0 = np.zeros(num_ranks)
    dirty = np.ones(num_ranks, dtype=np.bool_)
    finish = 0.0
    overcommitted = False
    for step in range(total):
        if use_fixed:
            for r in range(num_ranks):
                i = next_fixed[r]
                want[r] = fixed[i] if i < fixed_ptr[r + 1] else -1
        for r in range(num_ranks):
            if dirty[r]:
                cached_node[r], cached_t0[r] = _choose(
                    r, True, rdy_f, nf, rdy_b, nb, base, ready_time, prank, act, mem, limit,
                    free_at, last_fwd, want,
                )  # fmt: skip
                i = expect_ptr[r] + done_fb[r]
                c = cached_node[r]
                c_time = 0.0 if c < 0 else (bwd_time[c >> 1] if c & 1 else fwd_time[c >> 1])
                cached_node[r], cached_t0[r] = _choose_weight(
                    r, c, cached_t0[r], wq, wq_head, wq_tail, wgt_time, free_at,
                    overshoot, num_stages, nf[r] > 0,
                    expect_t[i] if i < expect_ptr[r + 1] else INF, c_time,
                    _weight_slack(r, wq_head, wq_cum, base, urg_pos, urg_red, free_at, red_free,
                                  deadline),
                )  # fmt: skip
                dirty[r] = False
        r, node, t0 = _earliest(cached_node, cached_t0)
        if r < 0:  # every rank waits: a W if any, rather than more memory
            r, node, t0 = _any_weight(wq, wq_head, wq_tail, free_at, num_stages)
        if r < 0:  # every rank is stuck at its memory limit: overcommit the earliest
            for q in range(num_ranks):
                cached_node[q], cached_t0[q] = _choose(
                    q, False, rdy_f, nf, rdy_b, nb, base, ready_time, prank, act, mem, limit,
                    free_at, last_fwd, want,
                )  # fmt: skip
            r, node, t0 = _earliest(cached_node, cached_t0)
            dirty[:] = True  # those were not the strict choices
        if r < 0:
            return 1, order, start, end, finish, peak, overcommitted, ready_time
        if node >= 2 * num_stages:  # a queued W: frees what its stage held for it
            k = node - 2 * num_stages
            wq_head[r] += 1
            stop = t0 + wgt_time[k]
            free_at[r] = stop
            mem[r] -= wgt_act[k]
            order[step], start[node], end[node] = node, t0, stop
            dirty[r] = True
            finish = max(finish, stop, _gradient_done(k, r, stop, red_grp, red_left, red_time,
                                                      red_free))  # fmt: skip
            continue
        k = node >> 1
        is_fwd = (node & 1) == 0
        done_fb[r] += 1
        if is_fwd:
            _pop(node, r, rdy_f, nf, base, slot)
            next_fixed[r] += use_fixed
        else:
            _pop(node, r, rdy_b, nb, base, slot)
        stop = t0 + (fwd_time[k] if is_fwd else bwd_time[k])
        free_at[r], last_fwd[r] = stop, is_fwd
        if is_fwd and has_backward[k]:
            mem[r] += act[k]
            overcommitted |= mem[r] > limit[r]
            peak[r] = max(peak[r], mem[r])
        elif not is_fwd and wgt_time[k] > 0:  # a split B: from now on its W holds wgt_act
            qs = wq_tail[r]
            wq[qs] = k
            wq_cum[qs] = wgt_time[k] + (wq_cum[qs - 1] if qs > base[r] else 0.0)
            wq_tail[r] += 1
            mem[r] += wgt_act[k] - act[k]
            overcommitted |= mem[r] > limit[r]
            peak[r] = max(peak[r], mem[r])
            g = red_grp[k]
            if g >= 0:
                grp_last[g] = qs
        elif not is_fwd:
            mem[r] -= act[k]
            finish = max(finish, _gradient_done(k, r, stop, red_grp, red_left, red_time,
                                                red_free))  # fmt: skip
        if not is_fwd and red_grp[k] >= 0:
            g = red_grp[k]
            b_left[g] -= 1
            # its last B: its W up to the last queued are now due by the deadline
            if b_left[g] == 0 and grp_last[g] >= max(wq_head[r], urg_pos[r] + 1):
                urg_pos[r], urg_red[r] = grp_last[g], red_time[g]
        order[step], start[node], end[node] = node, t0, stop
        dirty[r] = True
        for e in range(succ_ptr[node], succ_ptr[node + 1]):
            nxt = succ_node[e]
            ready_time[nxt] = max(ready_time[nxt], stop + succ_delay[e])
            npred[nxt] -= 1
            if npred[nxt] == 0:
                q = rank[nxt >> 1]
                dirty[q] = True
                if nxt & 1:
                    _push(nxt, q, rdy_b, nb, base, slot)
                else:
                    _push(nxt, q, rdy_f, nf, base, slot)
        finish = max(finish, stop)
    return 0, order, start, end, finish, peak, overcommitted, ready_time


@njit(cache=True)
def _gradient_done(k, r, stop, red_grp, red_left, red_time, red_free):
    """Stage k's gradients are complete at `stop` (its W or fused backward on rank r): when
    that completes its group, the group's reduction runs on r's reduction channel. Returns
    when r's reduction channel is free (0 when stage k has no reduction)."""
    g = red_grp[k]
    if g < 0:
        return 0.0
    red_left[g] -= 1
    if red_left[g] == 0:
        red_free[r] = max(stop, red_free[r]) + red_time[g]
    return red_free[r]


@njit(cache=True)
def _earliest(nodes, t0s):
    """(rank, node, start) of the earliest choice, lowest rank on ties; rank -1 if none."""
    best = -1
    for r in range(nodes.shape[0]):
        if nodes[r] >= 0 and (best < 0 or t0s[r] < t0s[best]):
            best = r
    if best < 0:
        return -1, -1, 0.0
    return best, nodes[best], t0s[best]


@njit(cache=True)
def _push(node, r, entries, counts, base, slot):
    i = base[r] + counts[r]
    entries[i] = node
    slot[node] = i
    counts[r] += 1


@njit(cache=True)
def _pop(node, r, entries, counts, base, slot):
    """Remove `node` from rank r's list (the list's last entry takes its place)."""
    last = base[r] + counts[r] - 1
    moved = entries[last]
    entries[slot[node]] = moved
    slot[moved] = slot[node]
    slot[node] = -1
    counts[r] -= 1
