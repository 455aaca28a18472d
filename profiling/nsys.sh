#!/usr/bin/env bash
# Run the mopd demo, or any command, under Nsight Systems: CUDA, NVTX, OS-runtime (and NCCL where
# this nsys can trace it), one report per rank, with the mopd profiler ranges switched on.
#
# Why this file exists: the pipeline's phases are NVTX ranges (mopd.common.ranges, on when
# MOPD_NVTX=1); this script is the one way to turn them into reports that can be opened side by
# side (nsys-ui "multi-report view"), one per torchrun rank.
#
# Usage:
#   mopd nsys [--out DIR] [--trace LIST] [--nsys-arg ARG]... [--dry-run] [-- COMMAND...]
#   (the installed package's copy of this script; in a checkout also bash profiling/nsys.sh ...)
#
#   (no command)           profiles `mopd demo` (or `python -m mopd.profiling.cli demo`)
#   -- torchrun ... X      rewritten so that every rank runs `nsys profile ... X` itself:
#                          torchrun <launcher options> --no-python nsys profile ... python [-m] X
#                          (also for `python -m torch.distributed.run ...`)
#   -- COMMAND             inside a rank already (RANK set): DIR/report-rank<RANK>.nsys-rep;
#                          otherwise one report for the command's process tree: DIR/report-<host>-<pid>
#
# Options:
#   --out DIR        report folder (default: $MOPD_NSYS_OUT or ./nsys-reports)
#   --trace LIST     nsys --trace list (default: $MOPD_NSYS_TRACE or cuda,nvtx,osrt, plus nccl when
#                    `nsys profile --help` lists it; NCCL's own NVTX ranges arrive via nvtx anyway)
#   --nsys-arg ARG   one extra argument for `nsys profile` (repeatable), e.g. --nsys-arg=--sample=none
#   --dry-run        print the command instead of running it (nsys need not be installed)
#
# Exit status: 2 when nsys is not on PATH (except for --dry-run) or the usage is wrong;
# otherwise the command's.
set -euo pipefail

prog=${MOPD_PROG:-$(basename "$0")}  # `mopd nsys` names itself
die() {
    echo "$prog: $*" >&2
    exit 2
}

usage() {
    sed -n '/^# Usage:/,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//'
}

out_dir=${MOPD_NSYS_OUT:-nsys-reports}
trace=${MOPD_NSYS_TRACE:-}
dry_run=0
extra=()
while (($#)); do
    case $1 in
        --out) (($# >= 2)) || die "--out needs a folder"; out_dir=$2; shift 2 ;;
        --out=*) out_dir=${1#--out=}; shift ;;
        --trace) (($# >= 2)) || die "--trace needs a list"; trace=$2; shift 2 ;;
        --trace=*) trace=${1#--trace=}; shift ;;
        --nsys-arg) (($# >= 2)) || die "--nsys-arg needs a value"; extra+=("$2"); shift 2 ;;
        --nsys-arg=*) extra+=("${1#--nsys-arg=}"); shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option '$1' (the command goes after --; see --help)" ;;
    esac
done
[[ -n $out_dir ]] || die "--out must not be empty"

nsys_bin=$(command -v nsys || true)
if [[ -z $nsys_bin ]]; then
    if ((dry_run)); then
        nsys_bin=nsys  # a dry run only prints the command: nsys is named there, not run
    else
        die "nsys (Nsight Systems CLI) is not on PATH; install Nsight Systems or add its bin" \
            "folder to PATH (e.g. /opt/nvidia/nsight-systems/<version>/bin); --dry-run prints" \
            "the command without it"
    fi
fi

if [[ -z $trace ]]; then
    trace=cuda,nvtx,osrt
    # Newer nsys versions trace NCCL directly (--trace=...,nccl); ask this one, from the
    # help text of its --trace option only (a dry run without nsys cannot ask).
    if [[ $nsys_bin == */* ]] && "$nsys_bin" profile --help 2>/dev/null \
        | awk '/--trace[=[:space:]]/ && !f {f=1; print; next}
               f && /^[[:space:]]*(-[A-Za-z], )?--[a-z]/ {exit}
               f {print}' \
        | grep -qiw nccl; then
        trace+=,nccl
    fi
fi

nsys_opts=(profile "--trace=$trace" --force-overwrite=true "${extra[@]+"${extra[@]}"}")

# The command: default demo.
if (($# == 0)); then
    if command -v mopd >/dev/null 2>&1; then
        set -- mopd demo
    else
        set -- "${PYTHON:-python}" -m mopd.profiling.cli demo
    fi
fi

# The mopd ranges are what the report is for.
export MOPD_NVTX=1

launcher_len=0
case $(basename -- "$1") in
    torchrun) launcher_len=1 ;;
    python | python3 | python3.*)
        if (($# >= 3)) && [[ $2 == -m && $3 == torch.distributed.run ]]; then
            launcher_len=3
        fi
        ;;
esac

if ((launcher_len > 0)); then
    # Split torchrun's own options from the training program with torchrun's own parser, then put
    # nsys inside each rank: torchrun ... --no-python nsys profile -o DIR/report-rank%q{RANK} PROG.
    launcher=("${@:1:launcher_len}")
    shift "$launcher_len"
    if ((launcher_len == 3)); then
        python_bin=${launcher[0]}
    else
        # The interpreter torchrun itself runs on (its console script's shebang), so that the
        # parser below and the ranks' `python` are the launcher's.
        python_bin=${PYTHON:-python}
        torchrun_path=$(command -v -- "${launcher[0]}" || true)
        if [[ -n $torchrun_path ]] && IFS= read -r shebang <"$torchrun_path" \
            && [[ $shebang =~ ^\#\!([^[:space:]]*python[^[:space:]]*)$ && -x ${BASH_REMATCH[1]} ]]; then
            python_bin=${BASH_REMATCH[1]}
        fi
    fi
    mapfile -d '' rewritten < <(
        "$python_bin" - "$nsys_bin" "$out_dir/report-rank%q{RANK}" "${nsys_opts[@]}" -- "$@" <<'PY'
import os
import sys

from torch.distributed.run import get_args_parser

argv = sys.argv[1:]
split = argv.index("--")
nsys_bin, output, nsys_opts, launcher_argv = argv[0], argv[1], argv[2:split], argv[split + 1 :]
args = get_args_parser().parse_args(launcher_argv)
if getattr(args, "run_path", False):
    sys.exit("nsys.sh: torchrun --run-path runs the script in the launcher; drop it to profile ranks")
tail = 1 + len(args.training_script_args)
options = launcher_argv[: len(launcher_argv) - tail]
assert launcher_argv[len(options)] == args.training_script, (launcher_argv, args.training_script)


def is_flag(token: str, full: str, min_prefix: str) -> bool:
    return token.startswith(min_prefix) and full.startswith(token)


options = [
    t
    for t in options
    if t != "-m"
    and not is_flag(t, "--module", "--mod")
    and not is_flag(t, "--no-python", "--no-")
    and not is_flag(t, "--no_python", "--no_")
]
program = [args.training_script, *args.training_script_args]
if not args.no_python:
    python = os.getenv("PYTHON_EXEC", sys.executable)
    program = [python, "-m", *program] if args.module else [python, *program]
cmd = [*options, "--no-python", nsys_bin, *nsys_opts, f"--output={output}", *program]
sys.stdout.write("".join(token + "\0" for token in cmd))
PY
    )
    ((${#rewritten[@]} > 0)) || die "could not split the torchrun command: $*"
    cmd=("${launcher[@]}" "${rewritten[@]}")
elif [[ -n ${RANK:-} ]]; then
    cmd=("$nsys_bin" "${nsys_opts[@]}" "--output=$out_dir/report-rank%q{RANK}" "$@")
else
    cmd=("$nsys_bin" "${nsys_opts[@]}" "--output=$out_dir/report-%h-%p" "$@")
fi

if ((dry_run)); then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi
mkdir -p -- "$out_dir"
echo "$prog: reports go to $out_dir (trace: $trace)" >&2
exec "${cmd[@]}"
