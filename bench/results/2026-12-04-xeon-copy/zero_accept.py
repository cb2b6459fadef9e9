"""How many verification steps accept nothing: the code edits' cached greedy answers
(var/bench/references/, written by replay.sh) replayed at one budget through the drafter
without and with its copy source, with and without the datastore. Prints a JSON line per
(datastore, config)."""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.draft_quality import accepted_along  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answers",
                        default="var/bench/references/*-code-edits-8-256-bfloat16.jsonl")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--datastore", default=None,
                        help="default: the ShareGPT datastore `sssd up` builds for SmolLM2")
    args = parser.parse_args()
    from sssd.common.drafting.proposer import DraftRequest
    from sssd.drafter.config import DrafterConfig, DraftParams
    from sssd.drafter.drafter import LocalDrafter

    if args.datastore is None:
        from sssd.cli.datastores import pick_datastore
        from sssd.common.model.tokenizer import load_tokenizer

        args.datastore = str(pick_datastore(None, load_tokenizer()))
    (path,) = glob.glob(args.answers)
    rows = [json.loads(line) for line in open(path)]
    for datastore in (None, args.datastore):
        for name, params in (("paper", DraftParams(copy_min_match=0)), ("copy", DraftParams())):
            drafter = LocalDrafter(DrafterConfig(datastore_dir=datastore, params=params,
                                                 num_threads=1)).start()
            steps = zero = 0
            for index, row in enumerate(rows):
                answer, position = row["output_ids"], 1
                new, first = row["prompt_ids"] + answer[:1], True
                while position < len(answer):
                    (tree,) = drafter.propose([DraftRequest(f"q{index}", new, args.budget,
                                                            is_start=first)])
                    accepted = accepted_along(tree, answer, position)
                    new = answer[position:position + accepted + 1]
                    position += len(new)
                    first = False
                    steps += 1
                    zero += accepted == 0
                drafter.end([f"q{index}"])
            drafter.close()
            print(json.dumps({"datastore": datastore is not None, "config": name,
                              "budget": args.budget, "steps": steps, "zero_accept_steps": zero,
                              "zero_share": zero / steps}), flush=True)


if __name__ == "__main__":
    main()
