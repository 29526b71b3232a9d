#!/usr/bin/env python3
"""Model check of the fused kernels' waits: no schedule of the CTAs can deadlock (CPU test).

The fused kernel's argument (docs/megakernel.md, "Task list", "The macrobatch ring"): GEMM tasks
go out in list order (task_list.cuh), each CTA runs the tasks it took in that order, and every
wait is on a task earlier in the list or on the dispatch, whose waits (with the macrobatch ring)
are on GEMM 1 tasks of earlier minibatches. This model plays it out over random layers and
random interleavings and fails if some state has unfinished work but nothing that can move:

  GEMM CTAs       take the next task from the counter while their pipeline (DEPTH tasks: the
                  feeder's, the producer's, the consumers') has room; the oldest runs once its
                  inputs exist, then finishes (and publishes) at some later step
  comm CTAs       dispatch their row tiles in increasing order (the first ring window over all of
                  them, the rest over the last ring_ctas), each tile of the ring after the tile
                  that last used its slot finished GEMM 1; then they join the GEMM work, except,
                  in some layers, comm CTA 0, which counts the pushed rows (the epilogue push with
                  the fused top-k sum): it waits for every routed tile's GEMM 2 in order and
                  never joins
  inputs          S2(r) <- every S1(r); G1(t) <- its minibatch dispatched, and with the ring every
                  G2(t - ring_tiles); G2(t) <- every G1(t)

The negative control (a ring of one minibatch, which Config::validate refuses) must deadlock
in some layer: the model can fail.

The fused backward (fused_backward.cu) runs on the same task list and roles, with its own waits
and a second phase of weight-gradient tasks after every dgrad task (backward_wgrad.cuh):

  tasks           S1 (shared dh, no wait), S2 (shared dx: its S1 row tile), G1 (routed dh: its
                  minibatch's dy rows pulled), G2 (routed dx: its G1 row tile), then WS (the
                  shared weight gradients: every S1 row tile) and W (an expert's weight
                  gradients: the pulls of its minibatches and every G1 row tile of its rows;
                  none for an expert without rows)
  comm CTAs       pull their dy row tiles (no wait); the first `combine` of them then push each
                  of their row tiles' dx (its G2 complete) and d topk_w (its G1 complete) and
                  meet at a barrier, never joining; the others join the GEMM work

Its negative control puts the weight-gradient tasks first in the list: then GEMM CTAs can all
hold W tasks whose G1 tiles nobody took, and some layer must deadlock.

usage: scripts/check_fused_schedule.py [--cases N] [--seed S]
"""
import argparse
import random
import sys

DEPTH = 3  # tasks a GEMM CTA holds: the feeder's, the producer's, the consumers'


def task_list(shared_tiles, sn1, n1, n2, tiles, tpm, rng):
    """TaskList::at's order, each block's tiles in a random order (the raster does not matter)."""
    def block(kind, rows, ncols):
        b = [(kind, r, n) for r in rows for n in range(ncols)]
        rng.shuffle(b)
        return b
    out = block("S1", range(shared_tiles), sn1) + block("S2", range(shared_tiles), n2)
    mbs = [list(range(m * tpm, min((m + 1) * tpm, tiles))) for m in range((tiles + tpm - 1) // tpm)]
    for j in range(len(mbs) + 1):
        if j < len(mbs):
            out += block("G1", mbs[j], n1)
        if j >= 1:
            out += block("G2", mbs[j - 1], n2)
    return out


class GemmCtas:
    """The GEMM CTAs of a model: each takes the next task of the list while its pipeline (DEPTH
    tasks) has room, starts the oldest once its inputs exist and finishes it at some later step."""

    def __init__(self, tasks, n, need):
        self.tasks, self.need = tasks, need
        self.fifos = [[] for _ in range(n)]  # each: FIFO of [task, started]
        self.next = 0
        self.done = {}  # (kind, tile) -> finished column blocks

    def complete(self, kind, tile):
        return self.done.get((kind, tile), 0) == self.need[kind]

    def join(self):  # a comm CTA done with its own work takes GEMM tasks from now on
        self.fifos.append([])

    def moves(self, inputs_ready):
        out = []
        for i, fifo in enumerate(self.fifos):
            if len(fifo) < DEPTH and self.next < len(self.tasks):
                out.append(("take", i))
            if fifo:
                if fifo[0][1]:
                    out.append(("finish", i))
                elif inputs_ready(fifo[0][0]):
                    out.append(("start", i))
        return out

    def apply(self, what, i):
        fifo = self.fifos[i]
        if what == "take":
            fifo.append([self.tasks[self.next], False])
            self.next += 1
        elif what == "start":
            fifo[0][1] = True
        else:
            kind, tile, _ = fifo.pop(0)[0]
            self.done[(kind, tile)] = self.done.get((kind, tile), 0) + 1

    def idle(self):  # every task taken and finished
        return self.next == len(self.tasks) and all(not f for f in self.fifos)


def simulate(p, rng):
    """True when every task finished; False on a deadlock."""
    tiles, tpm, ring_tiles = p["tiles"], p["tpm"], p["ring_mb"] * p["tpm"]
    tasks = task_list(p["shared"], p["sn1"], p["n1"], p["n2"], tiles, tpm, rng)
    gemm = GemmCtas(tasks, p["gemm"], {"S1": p["sn1"], "S2": p["n2"], "G1": p["n1"], "G2": p["n2"]})
    complete = gemm.complete
    dispatched = set()
    C = p["comm"]
    ring_ctas = min(p["ring_ctas"] or C, C)  # comm::dispatch_tiles: 0 or >= the CTAs: all of them
    window = min(tiles, ring_tiles) if ring_tiles else tiles
    comm_seq = []
    for c in range(C):
        seq = list(range(c, window, C))
        if ring_tiles and c >= C - ring_ctas:  # the last ring_ctas comm CTAs
            seq += list(range(ring_tiles + c - (C - ring_ctas), tiles, ring_ctas))
        elif not ring_tiles:
            seq = list(range(c, tiles, C))
        comm_seq.append(seq)
    comm_pos = [0] * C
    counting = bool(p.get("count"))  # comm CTA 0 counts the pushed rows (G2 tiles in order), never joins
    count_pos = 0

    def inputs_ready(t):
        kind, tile, _ = t
        if kind == "S1":
            return True
        if kind == "S2":
            return complete("S1", tile)
        if kind == "G1":
            m = tile // tpm
            if any(r not in dispatched for r in range(m * tpm, min((m + 1) * tpm, tiles))):
                return False
            return not ring_tiles or tile < ring_tiles or complete("G2", tile - ring_tiles)
        return complete("G1", tile)

    while True:
        moves = []
        for c in range(C):
            if comm_pos[c] < len(comm_seq[c]):
                t = comm_seq[c][comm_pos[c]]
                if not ring_tiles or t < ring_tiles or complete("G1", t - ring_tiles):
                    moves.append(("dispatch", c))
            elif c == 0 and counting and count_pos < tiles:
                if complete("G2", count_pos):
                    moves.append(("count", c))
            elif comm_pos[c] == len(comm_seq[c]) and not (c == 0 and counting):
                moves.append(("join", c))
        moves += gemm.moves(inputs_ready)
        if not moves:
            return gemm.idle() and all(
                comm_pos[c] > len(comm_seq[c]) or (c == 0 and counting) for c in range(C)) and (
                not counting or count_pos == tiles)
        what, i = rng.choice(moves)
        if what == "dispatch":
            dispatched.add(comm_seq[i][comm_pos[i]])
            comm_pos[i] += 1
        elif what == "count":
            count_pos += 1
        elif what == "join":
            comm_pos[i] += 1
            gemm.join()
        else:
            gemm.apply(what, i)


def simulate_backward(p, rng, wgrad_first=False):
    """The fused backward's waits (module docstring). True when everything finished."""
    expert_tiles, tpm, C = p["expert_tiles"], p["tpm"], p["comm"]
    tiles = sum(expert_tiles)
    first = [sum(expert_tiles[:e]) for e in range(len(expert_tiles))]
    dgrad = task_list(p["shared"], p["sn1"], p["n1"], p["n2"], tiles, tpm, rng)
    wgrad = [("WS", 0, w) for w in range(p["ws"] if p["shared"] else 0)]
    wgrad += [("W", e, w) for e in range(len(expert_tiles)) for w in range(p["w_per_expert"])]
    tasks = wgrad + dgrad if wgrad_first else dgrad + wgrad
    gemm = GemmCtas(tasks, p["gemm"], {"S1": p["sn1"], "S2": p["n2"], "G1": p["n1"], "G2": p["n2"], "WS": 1, "W": 1})
    complete = gemm.complete
    pulled = set()
    combine = min(p["combine"], C)
    pull_seq = [list(range(c, tiles, C)) for c in range(C)]
    push_seq = [list(range(c, tiles, combine)) if c < combine else [] for c in range(C)]
    # per comm CTA: phase 0 pull, 1 dx push, 2 d topk_w push, 3 at the barrier, 4 done (or joined)
    phase, pos = [0] * C, [0] * C

    def minibatch_pulled(m):
        return all(r in pulled for r in range(m * tpm, min((m + 1) * tpm, tiles)))

    def inputs_ready(t):
        kind, tile, _ = t
        if kind == "S1":
            return True
        if kind == "S2":
            return complete("S1", tile)
        if kind == "G1":
            return minibatch_pulled(tile // tpm)
        if kind == "G2":
            return complete("G1", tile)
        if kind == "WS":
            return all(complete("S1", r) for r in range(p["shared"]))
        rows = range(first[tile], first[tile] + expert_tiles[tile])  # W: tile = the expert
        return all(minibatch_pulled(r // tpm) and complete("G1", r) for r in rows)

    while True:
        moves = []
        for c in range(C):
            if phase[c] == 0:
                moves.append(("pull", c))
            elif phase[c] in (1, 2):
                if pos[c] == len(push_seq[c]):
                    moves.append(("next", c))
                elif complete("G2" if phase[c] == 1 else "G1", push_seq[c][pos[c]]):
                    moves.append(("push", c))
            elif phase[c] == 3 and all(phase[k] >= 3 for k in range(combine)):
                moves.append(("next", c))
        moves += gemm.moves(inputs_ready)
        if not moves:
            return gemm.idle() and all(ph == 4 for ph in phase)
        what, i = rng.choice(moves)
        if what == "pull":
            if pos[i] < len(pull_seq[i]):
                pulled.add(pull_seq[i][pos[i]])
                pos[i] += 1
            else:
                pos[i] = 0
                if i < combine:
                    phase[i] = 1
                else:
                    phase[i] = 4
                    gemm.join()
        elif what == "push":
            pos[i] += 1
        elif what == "next":
            pos[i] = 0
            phase[i] += 1
        else:
            gemm.apply(what, i)


def random_backward_layer(rng):
    experts = rng.randint(1, 5)
    comm = rng.randint(1, 4)
    return {
        "expert_tiles": [rng.choice([0, 1, 1, 2, 3]) for _ in range(experts)], "tpm": rng.randint(1, 3),
        "shared": rng.choice([0, 0, 1, 2]), "sn1": rng.randint(1, 2), "n1": rng.randint(1, 3),
        "n2": rng.randint(1, 3), "gemm": rng.randint(1, 4), "comm": comm,
        "combine": rng.choice([0, comm]),  # EP 1: none push; EP >= 2: all of them
        "ws": rng.randint(1, 3), "w_per_expert": rng.randint(1, 3),
    }


def check_backward(cases, rng):
    for i in range(cases):
        p = random_backward_layer(rng)
        for _ in range(4):
            if not simulate_backward(p, rng):
                sys.exit(f"check_fused_schedule: backward DEADLOCK in case {i}: {p}")
    for i in range(cases):
        p = random_backward_layer(rng)
        if any(not simulate_backward(p, rng, wgrad_first=True) for _ in range(4)):
            return p
    sys.exit("check_fused_schedule: the backward's negative control (weight-gradient tasks first) never "
             "deadlocked: the model cannot fail")


def random_layer(rng, ring_mb_choices):
    tpm = rng.randint(1, 3)
    return {
        "tiles": rng.randint(1, 14), "tpm": tpm, "ring_mb": rng.choice(ring_mb_choices),
        "shared": rng.choice([0, 0, 1, 2]), "sn1": rng.randint(1, 2), "n1": rng.randint(1, 3),
        "n2": rng.randint(1, 3), "gemm": rng.randint(1, 4), "comm": rng.randint(1, 4),
        "ring_ctas": rng.randint(0, 3), "count": rng.randint(0, 1),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=2026)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    for i in range(a.cases):
        p = random_layer(rng, [0, 2, 2, 3, 4])  # 0: every row resident; else >= 2 minibatches (Config::validate)
        for _ in range(4):
            if not simulate(p, rng):
                sys.exit(f"check_fused_schedule: DEADLOCK in case {i}: {p}")
    # Negative control: a ring of one minibatch deadlocks somewhere (GEMM 1 of m waits for GEMM 2
    # of m - 1, which the list hands out after it).
    found = None
    for i in range(a.cases):
        p = random_layer(rng, [1])
        if any(not simulate(p, rng) for _ in range(4)):
            found = p
            break
    if found is None:
        sys.exit("check_fused_schedule: the negative control (ring of one minibatch) never deadlocked: "
                 "the model cannot fail")
    print(f"check_fused_schedule: {a.cases} layers x 4 schedules without a deadlock "
          f"(rings of 0, 2, 3, 4 minibatches); the ring of one minibatch deadlocks, e.g. {found}")
    found_bwd = check_backward(a.cases, rng)
    print(f"check_fused_schedule: backward: {a.cases} layers x 4 schedules without a deadlock (EP 1 and "
          f"EP >= 2 comm roles); with the weight-gradient tasks first it deadlocks, e.g. {found_bwd}")


if __name__ == "__main__":
    main()
