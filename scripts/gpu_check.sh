#!/usr/bin/env bash
# The GPU check (issue 25, item 5): what has never run on a GPU, run on one, in <= 8 minutes.
#
#   scripts/gpu_check.sh            # on a machine with an NVIDIA GPU and a CUDA build of torch
#
# 1. prints nvidia-smi, the torch / CUDA / NCCL versions and the GPU;
# 2. builds (or loads) the C++ CPU Adam kernel once, so no test waits for its JIT build;
# 3. runs the GPU tests: python -m pytest -m gpu tests/test_gpu.py (a failed test is then
#    rerun alone, in a fresh process, while time is left: a CUDA error poisons the rest of
#    its process, so this tells a failure from its aftermath);
# 4. trains the Shakespeare GPT job (configs/_gpt_shakespeare.py, 300 steps) with
#    `python -m colossal_lite.cli train` on NCCL + CUDA, with a checkpoint at the end;
# 5. writes benchmarks/results/gpu_check.json: pass/fail, device, versions, test counts,
#    training loss and throughput, timings (and copies it, with the logs, into $OUT if set).
#
# Installs nothing that could replace torch: torch must already be there (a CUDA build). The
# package runs from this checkout (PYTHONPATH); `pip install -e . --no-deps` is tried only
# when it is not importable at all. Exit status 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
START=$SECONDS
LIMIT=${GPU_CHECK_LIMIT_S:-470}        # leave room under 8 minutes for the summary
WORK=$(mktemp -d -t colossal-lite-gpu-check-XXXXXX)
RESULT=${GPU_CHECK_RESULT:-$REPO/benchmarks/results/gpu_check.json}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
left() { echo $((LIMIT - (SECONDS - START))); }
say() { echo "== gpu_check [$((SECONDS - START))s]: $*"; }

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: no torch for $PY; install a CUDA build of torch first (this script installs none)" >&2
  exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi || true
else
  say "nvidia-smi not found"
fi
"$PY" - <<'EOF' | tee "$WORK/env.txt"
import torch
print('torch', torch.__version__, '| CUDA build', torch.version.cuda,
      '| cuda available', torch.cuda.is_available(), '| devices', torch.cuda.device_count())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), '| capability', torch.cuda.get_device_capability(0))
    try:
        print('nccl', '.'.join(map(str, torch.cuda.nccl.version())))
    except Exception as err:
        print('nccl unknown', err)
EOF
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device: the GPU tests would all skip" >&2
fi

# the package and its light dependencies (never torch)
if ! (cd / && PYTHONPATH= "$PY" -c 'import colossal_lite' 2>/dev/null); then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || say "pip install -e . --no-deps failed; running from the checkout (PYTHONPATH)"
fi
for mod in numpy tqdm pytest; do
  "$PY" -c "import $mod" 2>/dev/null || "$PY" -m pip install -q "$mod" \
    || say "could not install $mod"
done

say "C++ CPU Adam kernel (build or load once)"
if timeout 150 "$PY" -c 'from colossal_lite.nn.optimizer import active_backend; print("cpu adam:", active_backend())' \
    > "$WORK/kernel.txt" 2>&1; then
  tail -1 "$WORK/kernel.txt"
else
  tail -5 "$WORK/kernel.txt"
  say "kernel build failed or timed out: the tests use the torch CPU Adam (COLOSSAL_LITE_CPU_ADAM=torch)"
  export COLOSSAL_LITE_CPU_ADAM=torch
fi

say "GPU tests"
T0=$SECONDS
timeout $(( $(left) - 150 > 60 ? $(left) - 150 : 60 )) "$PY" -m pytest -m gpu -q -rs tests/test_gpu.py \
  --junitxml="$WORK/junit.xml" -o junit_family=xunit1 2>&1 | tee "$WORK/pytest.log"
PYTEST_RC=${PIPESTATUS[0]}
PYTEST_S=$((SECONDS - T0))

say "training run: the Shakespeare GPT job on NCCL + CUDA"
cat > "$WORK/gpt_gpu.py" <<EOF
_base_ = '$REPO/configs/_gpt_shakespeare.py'
backend = 'nccl'
train = dict(global_batch_size=16, steps=300, log_every=50, eval_batches=8, run_dir='$WORK/run')
checkpoint = dict(path='$WORK/ckpt', interval=300)
EOF
T0=$SECONDS
(cd "$WORK" && timeout 150 "$PY" -m colossal_lite.cli train "$WORK/gpt_gpu.py" --steps 300) \
  2>&1 | tee "$WORK/train.log"
TRAIN_RC=${PIPESTATUS[0]}
TRAIN_S=$((SECONDS - T0))

# each failed test alone, in a fresh process, while time is left
: > "$WORK/rerun.tsv"
if [ -f "$WORK/junit.xml" ]; then
  "$PY" - "$WORK/junit.xml" > "$WORK/failed.txt" <<'EOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter('testcase'):
    if case.find('failure') is not None or case.find('error') is not None:
        module = case.get('classname', '').replace('.', '/')
        print(f"{module}.py::{case.get('name')}")
EOF
  while read -r node; do
    [ -n "$node" ] || continue
    if [ "$(left)" -lt 40 ]; then echo -e "$node\tnot rerun (no time left)" >> "$WORK/rerun.tsv"; continue; fi
    say "rerun alone: $node"
    if timeout $(( $(left) - 10 )) "$PY" -m pytest -q -x "$node" > "$WORK/rerun.log" 2>&1; then
      echo -e "$node\tpassed alone" >> "$WORK/rerun.tsv"
    else
      echo -e "$node\tfailed alone" >> "$WORK/rerun.tsv"
      tail -30 "$WORK/rerun.log"
    fi
  done < "$WORK/failed.txt"
fi

"$PY" - "$WORK" "$RESULT" "$PYTEST_RC" "$PYTEST_S" "$TRAIN_RC" "$TRAIN_S" "$((SECONDS - START))" <<'EOF'
import datetime, json, os, re, socket, sys, xml.etree.ElementTree as ET
work, result, pytest_rc, pytest_s, train_rc, train_s, total_s = sys.argv[1:]
import torch

def text(name):
    path = os.path.join(work, name)
    return open(path, errors='replace').read() if os.path.exists(path) else ''

tests = {'rc': int(pytest_rc), 'seconds': int(pytest_s)}
junit = os.path.join(work, 'junit.xml')
if os.path.exists(junit):
    cases = list(ET.parse(junit).iter('testcase'))
    def outcome(case):
        for tag in ('failure', 'error', 'skipped'):
            if case.find(tag) is not None:
                return tag
        return 'passed'
    outcomes = [outcome(c) for c in cases]
    tests.update({k: outcomes.count(k) for k in ('passed', 'failure', 'error', 'skipped')})
    tests['failed_tests'] = [c.get('name') for c, o in zip(cases, outcomes) if o in ('failure', 'error')]
    tests['skipped_tests'] = [c.get('name') for c, o in zip(cases, outcomes) if o == 'skipped']
    tests['test_seconds'] = {c.get('name'): round(float(c.get('time', 0)), 2) for c in cases}
tests['rerun_alone'] = dict(line.split('\t', 1) for line in text('rerun.tsv').splitlines() if '\t' in line)

log = text('train.log')
train = {'rc': int(train_rc), 'seconds': int(train_s)}
m = re.search(r'summary: steps=(\d+) first_loss=([\d.]+) last_loss=([\d.]+) \((fell|did not fall)\) wall=([\d.]+)s', log)
if m:
    train.update(steps=int(m[1]), first_loss=float(m[2]), last_loss=float(m[3]),
                 loss_fell=m[4] == 'fell', wall_s=float(m[5]))
m = re.search(r'throughput: ([\d.]+) tokens/s \(global\), ([\d.]+) s/step', log)
if m:
    train.update(tokens_per_s=float(m[1]), s_per_step=float(m[2]))
m = re.search(r'peak memory per rank \(MiB\): rank 0: (\d+)', log)
if m:
    train['peak_mib'] = int(m[1])
m = re.search(r'evaluation: test_loss=([\d.]+)', log)
if m:
    train['test_loss'] = float(m[1])
train['checkpoint_written'] = os.path.isfile(os.path.join(work, 'ckpt', 'common.pt'))

cuda = torch.cuda.is_available()
ok_tests = tests['rc'] == 0 and tests.get('passed', 0) > 0 and not tests.get('failed_tests')
ok_train = train['rc'] == 0 and train.get('loss_fell', False) and train['checkpoint_written']
summary = {
    'overall': 'pass' if (cuda and ok_tests and ok_train) else 'fail',
    'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'host': socket.gethostname(),
    'device': torch.cuda.get_device_name(0) if cuda else None,
    'gpus': torch.cuda.device_count(),
    'torch': torch.__version__, 'cuda': torch.version.cuda,
    'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if cuda else None,
    'cpu_adam': (text('kernel.txt').strip().splitlines() or ['?'])[-1],
    'tests': tests, 'train': train, 'total_seconds': int(total_s),
}
os.makedirs(os.path.dirname(result), exist_ok=True)
with open(result, 'w') as f:
    json.dump(summary, f, indent=1)
print(json.dumps({k: summary[k] for k in ('overall', 'device', 'torch', 'cuda', 'total_seconds')}))
print('tests:', {k: tests.get(k) for k in ('passed', 'failure', 'error', 'skipped', 'seconds')},
      'failed:', tests.get('failed_tests'), 'rerun alone:', tests['rerun_alone'])
print('train:', train)
print('wrote', result)
sys.exit(0 if summary['overall'] == 'pass' else 1)
EOF
STATUS=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$RESULT" "$WORK"/*.log "$WORK"/*.txt "$WORK"/junit.xml "$OUT"/ 2>/dev/null || true
fi
say "done (status $STATUS); logs in $WORK"
exit $STATUS
