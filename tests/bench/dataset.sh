# shellcheck shell=bash
# Sourced by the benchmarks: make_dataset DIR FILES writes an ImageFolder of FILES files in 20
# classes, ~110 KB on average (20 KB to 300 KB, as ImageNet's JPEGs), the same bytes every run.
make_dataset() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import os, random, sys
root, files = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
for i in range(files):
    d = os.path.join(root, f"class{i % 20:03d}")
    os.makedirs(d, exist_ok=True)
    size = 20_000 + rng.randrange(180_000) + (100_000 if rng.randrange(7) == 0 else 0)
    with open(os.path.join(d, f"img{i:06d}.jpg"), "wb") as f:
        f.write(rng.randbytes(size))
PY
}
