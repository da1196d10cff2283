import sys, collections
f = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
self_c = collections.Counter(); incl = collections.Counter(); total = 0
for line in open(f):
    stack, _, cnt = line.rstrip().rpartition(' ')
    cnt = int(cnt); total += cnt
    frames = stack.split(';')
    self_c[frames[-1]] += cnt
    for fr in set(frames):
        incl[fr] += cnt
print("total", total)
print("--- self")
for k, v in self_c.most_common(n): print(f"{v:5d} {100*v/total:5.1f}% {k[:150]}")
print("--- inclusive")
for k, v in incl.most_common(n*2): print(f"{v:5d} {100*v/total:5.1f}% {k[:150]}")
