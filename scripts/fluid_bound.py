"""Fluid upper bound on block hits for online eviction policies that know only
per-block features (issue 16 experiment, branch issue16-gd).

Each access of a full block starts a "life" whose class is a feature tuple
(mode `count`: prior accesses, capped at 4; `iv`: + log4 of the last
inter-access gap; `turn`: + the conversation turn, i.e. prior accesses of the
request's second block; `all`: all three). A policy that sees only the class
and the age can only choose, per class, how long to keep a block after an
access; relaxing the capacity to an average (Lagrangian) gives an upper bound
on the hits of every such policy. With one class it approximates LRU (within
~0.6-1.6 pp below the real replay).

usage: python3 scripts/fluid_bound.py TRACE.jsonl none|count|iv|turn|all
"""
import json, sys, collections, bisect, math
reqs=[json.loads(l) for l in open(sys.argv[1])]
mode=sys.argv[2]
uses=collections.defaultdict(list); cls=collections.defaultdict(list)
seen=collections.Counter(); last={}
for ri,r in enumerate(reqs):
    hs=r['hash_ids'][:-1]
    turn=min(seen[hs[1]],6) if len(hs)>1 else 0
    for pos,h in enumerate(hs):
        c=min(seen[h],4)
        iv=ri-last[h] if h in last else 0
        ivb=min(int(math.log2(iv+1))//2,6)
        if mode=='none': k=0
        elif mode=='count': k=c
        elif mode=='iv': k=(c,ivb)
        elif mode=='turn': k=(c,turn)
        elif mode=='all': k=(c,turn,ivb)
        elif mode=='pos': k=(c,min(pos.bit_length(),6))
        uses[h].append(ri); cls[h].append(k); seen[h]+=1; last[h]=ri
uniq=len(set(h for r in reqs for h in r['hash_ids'])); N=len(reqs); INF=10**9
ev=collections.defaultdict(list)
for h,u in uses.items():
    for i,ri in enumerate(u): ev[cls[h][i]].append(u[i+1]-ri if i+1<len(u) else INF)
acc=sum(len(r['hash_ids']) for r in reqs)
ages=sorted(set(int(math.exp(x*math.log(N)/150)) for x in range(151)))
cur={}
for c,ts in ev.items():
    ts.sort(); fin=[t for t in ts if t<INF]; cs=[0]
    for t in fin: cs.append(cs[-1]+t)
    hs=[];co=[]
    for a in ages:
        k=bisect.bisect_right(fin,a); hs.append(k); co.append(cs[k]+(len(ts)-k)*a)
    cur[c]=(hs,co)
out=[]
for cap in [0.01,0.02,0.05,0.1]:
    budget=cap*uniq*N; best=None
    for j in range(120):
        lam=10**(-7+6*j/120); H=0;Cs=0
        for c,(hs,co) in cur.items():
            bi=max(range(len(ages)),key=lambda i:hs[i]-lam*co[i])
            if hs[bi]-lam*co[bi]>0: H+=hs[bi];Cs+=co[bi]
        if Cs<=budget and (best is None or H>best): best=H
    out.append(f"{best/acc*100:.1f}")
print(sys.argv[1],mode,len(ev),'classes:',' '.join(out))
