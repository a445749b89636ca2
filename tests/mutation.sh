#!/usr/bin/env bash
# Mutation check (issue 15), outside CI; docs/testing.md gives the scores and the known equivalents.
#   bash tests/mutation.sh               # all of it
#   bash tests/mutation.sh 'schedules*'  # only these mutmut mutants (fnmatch on names), then the hand mutants
# 1. mutmut, from a fresh mutants/ folder, over the files and tests named in pyproject's [tool.mutmut];
#    the CLI parts are left out by a `# pragma: no mutate block` line. Counts per file, then the survivors.
# 2. Hand mutants mutmut cannot make, each in a scratch copy of the repository: its test must pass
#    before and fail after.
# Needs mutmut (requirements-dev.txt) in the active environment.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1  # one torch thread per test process; mutmut runs one process per core

rm -rf mutants
mutmut run --max-children "$(nproc)" "$@"
echo
mutmut results --all true | awk '{split($1, name, "."); status = $0; sub(/^[^:]*: /, "", status)
        total[name[1]]++; count[name[1], status]++}
    END {for (f in total) printf "%s.py: %d mutants, %d killed, %d survived, %d other\n", f, total[f],
         count[f, "killed"], count[f, "survived"], total[f] - count[f, "killed"] - count[f, "survived"]}'
mutmut results

hand_mutant() {  # FILE OLD NEW TEST: TEST passes, then fails once OLD in FILE reads NEW
    local scratch clean=0 mutated=0
    scratch=$(mktemp -d)
    git ls-files -z | xargs -0 cp --parents -t "$scratch"
    (cd "$scratch" && python -m pytest -q -x "$4" >/dev/null 2>&1) || clean=$?
    python - "$scratch/$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"{old!r} is not in {path} exactly once"
open(path, "w").write(text.replace(old, new))
PY
    (cd "$scratch" && python -m pytest -q -x "$4" >/dev/null 2>&1) || mutated=$?
    rm -rf "$scratch"
    if [[ $clean == 0 && $mutated == 1 ]]; then
        echo "hand mutant killed by $4: $1: $2 -> $3"
    else
        echo "hand mutant NOT killed by $4 (pytest exit $clean clean, $mutated mutated): $1: $2 -> $3"
        return 1
    fi
}
hand_mutant train.py "(scaler.scale(loss) if scaler else loss).backward(weight)" "(scaler.scale(loss) if scaler else loss).backward()" \
    tests/test_accumulation.py
hand_mutant machinery/resume.py 'restore_rng_state(self.state["rng"])' 'pass' \
    tests/test_resume.py::test_kill_9_mid_epoch_then_resume_is_bit_identical
