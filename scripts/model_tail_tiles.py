#!/usr/bin/env python3
"""Model of the routed row tiles under uniform random top-k routing (pure Python, no numpy):
per rank, the 128-row tiles, their padding, the tail tiles with <= 64 real rows, and the
share of the routed tile work that two ways of computing such tails would save (docs/gemm.md,
2026-12-02): a pair tile (two experts' tails, 2 B tiles per K step, ~1.67 full tiles
for two tails at the L2 -> SM fill bound) and a wide tail tile (one tail, 2 column blocks,
64-row A box: 8 + 64 KiB per K step = 1.5 full tiles for two column blocks). Usage: python3 scripts/model_tail_tiles.py (about 5 s)."""
import random
random.seed(1)
def model(name,E,K,T,ep,trials=4):
    acc=[0,0,0,0,0]
    for _ in range(trials):
        counts=[0]*E
        for _ in range(T*ep):
            for e in random.sample(range(E),K): counts[e]+=1
        loc=[c for c in counts[:E//ep]]
        tiles=[(c+127)//128 for c in loc]
        small=sum(1 for c,t in zip(loc,tiles) if c>0 and c-(t-1)*128<=64)
        acc[0]+=sum(tiles); acc[1]+=small; acc[2]+=small//2; acc[3]+=sum(loc); acc[4]+=sum(tiles)*128
    tot,sm,pr,rows,cap=[a/trials for a in acc]
    pair = pr * (2 - 1.67) / tot      # per pair of tails: 1.67 full tiles instead of 2
    wide = sm * (1 - 1.5 / 2) / tot   # per tail: each column-block pair at 1.5 instead of 2
    print(f"{name} ep{ep}: row tiles {tot:.0f}, padding {(1-rows/cap)*100:.1f}%, tails<=64 {sm:.0f}; "
          f"routed tile work saved: pair tiles {pair*100:.1f}%, wide tail tiles {wide*100:.1f}%")
model("dsv3",256,8,8192,1); model("dsv3",256,8,8192,2); model("dsv3",256,8,8192,8,2)
model("qwen3",128,8,16384,1); model("qwen3",128,8,16384,2)
model("gptoss",128,4,8192,1); model("gptoss",128,4,8192,2)
