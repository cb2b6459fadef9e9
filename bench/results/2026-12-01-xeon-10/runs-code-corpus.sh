# Python sources as a code corpus beside ShareGPT (the packages of the project's own .venv,
# its *.py files under 1 MiB: 16,936 documents, 60.7 M tokens in Qwen's tokenizer), scored by replay against
# ShareGPT alone. Then the same two shards with ShareGPT weighted 3x and 10x: shard weights
# apply to shards of the served model's own text, so a copy marks ShareGPT's shard as such.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-xeon-10
SG=var/demo-datastore/sharegpt-12000-3f34145de91b
D=var/bench/datastores/sharegpt+site-packages
rm -rf $D && mkdir -p var/bench/datastores && cp -r $SG $D
.venv/bin/sssd-indexer offline --model qwen-coder-1.5b --append --datastore-dir $D \
  .venv/lib/python3.11/site-packages > $R/code-corpus-index.log 2>&1
.venv/bin/python bench/draft_quality.py --model qwen-coder-1.5b --sets code,mt_bench --prompts 24 \
  --budgets 8,16,32,256 --datastore $SG --datastore $D \
  > $R/draft-quality-code-corpus.jsonl 2> $R/draft-quality-code-corpus.err
W=var/bench/datastores/sharegpt-weighted+site-packages
rm -rf $W && cp -r $D $W
sed -i 's/"origin": "corpus"/"origin": "model"/' $W/shard-000000/meta.json
.venv/bin/python bench/draft_quality.py --model qwen-coder-1.5b --sets code,mt_bench --prompts 24 \
  --budgets 8,16,32 --datastore $W --config w3:model_shard_weight=3 \
  --config w10:model_shard_weight=10 \
  > $R/draft-quality-code-corpus-weighted.jsonl 2> $R/draft-quality-code-corpus-weighted.err
