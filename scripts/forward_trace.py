#!/usr/bin/env python3
"""Where the fused forward's time goes: reads the trace files of a -DMOK_FORWARD_TRACE build
(bench_forward --trace PREFIX writes PREFIX-<shape>-c<C>-r<rank>.bin; layout in
src/megakernel/forward_trace.cuh) and prints, per file:

  - the host-event phases: before the kernel (segments, x staging, memsets), the kernel, after
    it (top-k sum epilogue);
  - the comm CTAs: first barrier, end of dispatch, end of combine, last barrier (ms from the
    kernel's first stamp; median and max over the comm CTAs);
  - the GEMM CTAs: span, time inside tiles per task kind, and the time the consumer had
    nothing to do because the task's inputs were not there yet (producer's input wait that
    ended after the consumer finished its previous tile), per kind;
  - a timeline in bins: the fraction of GEMM CTAs inside a tile of each kind;
  - the lockstep of routed tasks that may share a B tile ((rt, n) and (rt + 1, n) begin times);
  - with the fused top-k sum (version-2 files): when tokens were claimed, ready and summed,
    by comm CTAs or GEMM CTAs, and the tail after the last GEMM tile.

usage: scripts/forward_trace.py FILE... [--bins 20]
"""
import argparse
import struct
import sys

import numpy as np

KINDS = ["S1", "S2", "G1", "G2", "WS", "W"]  # WS, W: the fused backward's weight gradients
MAGIC = 0x52544457464B4F4D


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    h = struct.unpack("<10q", raw[:80])
    if h[0] != MAGIC or h[1] not in (1, 2, 3):
        sys.exit(f"{path}: not a version-1, -2 or -3 forward trace")
    grid, comm_ctas, max_tasks, cf, tf = h[2:7]
    phases_ms = [x / 1e6 for x in h[7:10]]
    words = np.frombuffer(raw[80:], dtype=np.uint64)
    rows = grid if h[1] >= 3 else grid - comm_ctas  # v3: comm CTAs that joined the GEMM work too
    nc, ng = comm_ctas * cf, rows * max_tasks * tf
    comm = words[:nc].reshape(comm_ctas, cf).astype(np.int64)
    gemm = words[nc:nc + ng].reshape(rows, max_tasks, tf).astype(np.int64)
    if h[1] >= 3:  # keep the GEMM CTAs and the comm CTAs that ran tasks
        ran = (gemm[:, :, 4] > 0).any(axis=1)
        ran[: grid - comm_ctas] = True
        gemm = gemm[ran]
    tokens = None
    if h[1] >= 2:
        n = int(words[nc + ng])
        if n > 0:
            tokens = words[nc + ng + 1:].reshape(n, 4).astype(np.int64)  # claim, ready, done, who
    return dict(grid=grid, comm_ctas=comm_ctas, phases_ms=phases_ms, comm=comm, gemm=gemm, tokens=tokens)


def report(path, t, bins):
    comm, gemm = t["comm"], t["gemm"]
    valid = gemm[:, :, 4] > 0  # epilogue end stamped
    starts = [comm[:, 0].min()] + ([gemm[:, :, 0][gemm[:, :, 0] > 0].min()] if valid.any() else [])
    t0 = min(starts)
    ms = lambda x: (x - t0) / 1e6  # noqa: E731
    pre, kern, post = t["phases_ms"]
    print(f"== {path}: grid {t['grid']}, comm CTAs {t['comm_ctas']}")
    print(f"host events: before kernel {pre:.3f} ms, kernel {kern:.3f} ms, after {post:.3f} ms, "
          f"total {pre + kern + post:.3f} ms")
    last = "sum end" if t["tokens"] is not None else "barrier 2"  # the fused sum replaces barrier 2
    names = ["start", "barrier 1", "dispatch end", "combine end", last]
    def field(i):  # comm CTAs that joined the GEMM work stamp nothing after their dispatch
        v = comm[:, i][comm[:, i] > 0]
        return f"{np.median(ms(v)):.3f}/{ms(v).max():.3f}" if v.size else "-"
    row = ", ".join(f"{n} {field(i)}" for i, n in enumerate(names))
    print(f"comm CTAs (ms, median/max): {row}")
    end = max(comm[:, 4].max(), gemm[:, :, 4].max())
    span = (end - t0) / 1e6
    kind = (gemm[:, :, 5] & 0xFF).astype(int)
    mb = ((gemm[:, :, 5] >> 8) & 0xFFFF).astype(int)
    tile = (gemm[:, :, 4] - gemm[:, :, 2]) / 1e6
    main = (gemm[:, :, 3] - gemm[:, :, 2]) / 1e6
    # Consumer idle because the inputs were late: the consumer started the tile (and waits for
    # its first stage inside the K loop) before the producer's input wait ended.
    late = np.clip(gemm[:, :, 1] - gemm[:, :, 2], 0, None) / 1e6
    late = np.where(valid, np.minimum(late, tile), 0)
    work = np.where(valid, tile - late, 0)
    ng = gemm.shape[0]
    last_end = np.array([ms(gemm[c, valid[c], 4]).max() if valid[c].any() else 0 for c in range(ng)])
    joined = ng - (t["grid"] - t["comm_ctas"])
    print(f"span {span:.3f} ms; GEMM CTAs {ng} ({joined} of them comm CTAs that joined): last tile ends at {np.median(last_end):.3f} (median) / "
          f"{last_end.min():.3f}-{last_end.max():.3f} ms; tasks recorded {int(valid.sum())}")
    tot = ng * span
    first = np.array([ms(gemm[c, 0, 0]) if valid[c, 0] else 0 for c in range(ng)])
    print(f"{'kind':4} {'tasks':>6} {'work ms':>9} {'of CTA-time':>11} {'per tile us':>11} {'K loop us':>9} "
          f"{'input-late ms':>13} {'of CTA-time':>11}")
    for k, name in enumerate(KINDS):
        sel = valid & (kind == k)
        if not sel.any():
            continue
        print(f"{name:4} {int(sel.sum()):6d} {work[sel].sum():9.2f} {work[sel].sum() / tot:11.3f} "
              f"{1e3 * work[sel].mean():11.1f} {1e3 * main[sel].mean():9.1f} {late[sel].sum():13.2f} "
              f"{late[sel].sum() / tot:11.3f}")
    # Tiles with <= 64 real rows (their second consumer warpgroup computes only padding rows)
    # against the others, per kind (traces since d339d83 carry the real rows).
    real = ((gemm[:, :, 5] >> 56) & 0xFF).astype(int)
    if (real[valid] > 0).any():
        parts = []
        for k, name in enumerate(KINDS):
            for label, sel in (("<=64", valid & (kind == k) & (real <= 64)), (">64", valid & (kind == k) & (real > 64))):
                if sel.any():
                    parts.append(f"{name} {label} {int(sel.sum())} x {1e3 * work[sel].mean():.1f}/{1e3 * main[sel].mean():.1f}")
        print("by real rows (tasks x per tile us / K loop us): " + ", ".join(parts))
    # Lockstep (docs/megakernel.md, 2026-12-02): tasks (rt, n) and (rt + 1, n) share
    # their B tile when both row tiles belong to one expert, and one DRAM read serves both only
    # while they run in step. Their begin-time difference, per routed kind (the trace has no
    # expert id, so pairs across an expert boundary are counted too).
    row_tile = ((gemm[:, :, 5] >> 40) & 0xFFFF).astype(int)
    n_tile = ((gemm[:, :, 5] >> 24) & 0xFFFF).astype(int)
    parts = []
    for k in (2, 3):
        sel = valid & (kind == k)
        begin = {(int(r), int(n)): int(b) for r, n, b in zip(row_tile[sel], n_tile[sel], gemm[:, :, 2][sel])}
        d = np.array([abs(b - begin[(r + 1, n)]) / 1e3 for (r, n), b in begin.items() if (r + 1, n) in begin])
        if d.size:
            parts.append(f"{KINDS[k]} median {np.median(d):.1f}, 90 % {np.quantile(d, 0.9):.1f}, "
                         f"> 20 us {100 * (d > 20).mean():.1f} % of {d.size} pairs")
    if parts:
        print("lockstep |begin(rt, n) - begin(rt + 1, n)| (us): " + "; ".join(parts))
    busy, wait = work.sum(), late.sum()
    idle_end, idle_start = (span - last_end).sum(), first.sum()
    print(f"all  working {busy / tot:.3f} of GEMM CTA-time, waiting for inputs {wait / tot:.3f}, "
          f"before the first tile {idle_start / tot:.3f}, after the last tile {idle_end / tot:.3f}, "
          f"between tiles {(tot - busy - wait - idle_end - idle_start) / tot:.3f}")
    # Consumer gaps between one task's epilogue-end stamp and the next task's begin stamp (the
    # two stamps are adjacent in the consumer's loop): their distribution, and the CTA-time
    # before each CTA's first tile begins after its feeder's first stamp.
    both = valid[:, :-1] & valid[:, 1:]
    gaps = (gemm[:, 1:, 2] - gemm[:, :-1, 4])[both] / 1e3
    if gaps.size:
        q = np.quantile(gaps, [0.5, 0.9, 0.99])
        print(f"gaps between tiles (us): median {q[0]:.2f}, 90 % {q[1]:.2f}, 99 % {q[2]:.2f}, max {gaps.max():.1f}; "
              f"sum {gaps.sum() / 1e3 / tot:.3f} of GEMM CTA-time; first tile after the feeder's first stamp "
              f"{np.mean([(gemm[c, 0, 2] - gemm[c, 0, 0]) / 1e3 for c in range(ng) if valid[c, 0]]):.1f} us (mean)")
    # Minibatch readiness: earliest end of a G1(m) input wait that actually waited.
    g1 = valid & (kind == 2)
    if g1.any():
        ms_seen = sorted(set(mb[g1].tolist()))
        step = max(1, len(ms_seen) // 8)
        pick = ms_seen[::step] + ([ms_seen[-1]] if ms_seen[-1] not in ms_seen[::step] else [])
        parts = []
        for m in pick:
            sel = g1 & (mb == m)
            parts.append(f"m{m} {ms(gemm[:, :, 1][sel]).min():.3f}/{ms(gemm[:, :, 2][sel]).min():.3f}/"
                         f"{ms(gemm[:, :, 4][sel]).max():.3f}")
        print("G1(m) inputs first ready / first tile start / last tile end (ms): " + ", ".join(parts))
    if t["tokens"] is not None:
        report_tokens(t, ms, last_end, t0)
    # Timeline: fraction of GEMM CTAs inside a tile of each kind per bin.
    edges = np.linspace(0, span, bins + 1)
    print(f"timeline ({bins} bins of {span / bins * 1e3:.0f} us): fraction of GEMM CTAs in S1 S2 G1 G2 | "
          f"comm CTAs dispatching, combining")
    b0, b1 = ms(gemm[:, :, 2]), ms(gemm[:, :, 4])
    for i in range(bins):
        lo, hi = edges[i], edges[i + 1]
        ov = np.clip(np.minimum(b1, hi) - np.maximum(b0, lo), 0, None) * valid
        fr = [ov[kind == k].sum() / (ng * (hi - lo)) for k in range(len(KINDS))]
        d = np.clip(np.minimum(ms(comm[:, 2]), hi) - np.maximum(ms(comm[:, 1]), lo), 0, None).sum()
        c = np.clip(np.minimum(ms(comm[:, 3]), hi) - np.maximum(ms(comm[:, 2]), lo), 0, None).sum()
        nc = max(1, comm.shape[0]) * (hi - lo)
        print(f"  {lo:6.3f}-{hi:6.3f}  " + " ".join(f"{x:4.2f}" for x in fr) + f" | {d / nc:4.2f} {c / nc:4.2f}")


def report_tokens(t, ms, last_end, t0):
    tok = t["tokens"]
    done = tok[:, 2] > 0
    if not done.any():
        print("fused top-k sum: no token stamped")
        return
    claim, ready, fin = ms(tok[:, 0]), ms(tok[:, 1]), ms(tok[:, 2])
    by_comm = tok[:, 3] < t["comm_ctas"]
    n = int(done.sum())
    tail0 = np.median(last_end)
    tail = done & (fin > tail0)
    print(f"fused top-k sum: {n} tokens, {int((done & by_comm).sum())} by comm CTAs; waited for rows (ready - claim) "
          f"mean {1e3 * (ready - claim)[done].mean():.1f} us, summing (done - ready) mean {1e3 * (fin - ready)[done].mean():.1f} us "
          f"(comm {1e3 * (fin - ready)[done & by_comm].mean() if (done & by_comm).any() else 0:.1f}, "
          f"GEMM {1e3 * (fin - ready)[done & ~by_comm].mean() if (done & ~by_comm).any() else 0:.1f})")
    print(f"  after the median last GEMM tile ({tail0:.3f} ms): {int(tail.sum())} tokens summed "
          f"({int((tail & (claim > tail0)).sum())} claimed only then), last done {fin[done].max():.3f} ms")
    edges = np.quantile(fin[done], [0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
    rq = np.quantile(ready[done], [0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
    print("  quantiles 10/25/50/75/90/99 %: ready " + " ".join(f"{x:.3f}" for x in rq) +
          " | done " + " ".join(f"{x:.3f}" for x in edges) + " ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--bins", type=int, default=20)
    a = ap.parse_args()
    for p in a.files:
        report(p, load(p), a.bins)


if __name__ == "__main__":
    main()
