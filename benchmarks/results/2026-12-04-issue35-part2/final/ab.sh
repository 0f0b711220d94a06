#!/bin/bash
# interleaved before (d7452f9) / final (9862eb5): disaggregated serving quick, offline fp32
set -u
OUT=/tmp/ab2; PY=/work/main/.venv/bin/python
for round in 1 2; do
  for tree in before after; do
    cd /tmp/$tree
    $PY -m benchmarks.bench_serve --quick --systems disaggregated --json $OUT/serve-$tree-$round.json > $OUT/serve-$tree-$round.log 2>&1
    $PY -m benchmarks.bench_offline --dtypes float32 --num-prompts 24 --prompt-len 256 --output-len 64 --settings 2048:512 --skip-hf --json $OUT/offline-$tree-$round.json > $OUT/offline-$tree-$round.log 2>&1
    echo "$tree $round done $(date +%T)"
  done
done
