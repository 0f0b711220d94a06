#!/bin/bash
# interleaved before/after: offline fp32, quant (none,int4) quick, speculative quick
set -u
OUT=/tmp/ab; mkdir -p $OUT
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for tree in before main; do
    dir=/tmp/before; [ $tree = main ] && dir=/work/main
    cd $dir
    $PY -m benchmarks.bench_offline --dtypes float32 --num-prompts 24 --prompt-len 256 --output-len 64 --settings 2048:512 --skip-hf --json $OUT/offline-$tree-$round.json > $OUT/offline-$tree-$round.log 2>&1
    $PY -m benchmarks.bench_quant --modes none,int4 --quick --json $OUT/quant-$tree-$round.json > $OUT/quant-$tree-$round.log 2>&1
    $PY -m benchmarks.bench_speculative --quick --json $OUT/spec-$tree-$round.json > $OUT/spec-$tree-$round.log 2>&1
    echo "$tree $round done $(date +%T)"
  done
done
