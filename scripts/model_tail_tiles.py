#!/usr/bin/env python3
"""Model of the routed row tiles under uniform random top-k routing (pure Python, no numpy):
per rank, the 128-row tiles, their padding, the tail tiles with <= 64 real rows, and what
pairing two such tails in one tile (docs/gemm.md, "Tail pairs") would save at a given cost of a
pair tile relative to a full one. Usage: python3 scripts/model_tail_tiles.py (about 5 s)."""
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
    print(f"{name} ep{ep}: row tiles {tot:.0f}, padding {(1-rows/cap)*100:.1f}%, tails<=64 {sm:.0f}, pairs {pr:.0f}; "
          f"tile work saved at pair cost 1.67 / 1.5 of a full tile: {pr*0.33/tot*100:.1f}% / {pr*0.5/tot*100:.1f}%")
model("dsv3",256,8,8192,1); model("dsv3",256,8,8192,2); model("dsv3",256,8,8192,8,2)
model("qwen3",128,8,16384,1); model("qwen3",128,8,16384,2)
model("gptoss",128,4,8192,1); model("gptoss",128,4,8192,2)
