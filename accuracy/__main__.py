"""``python -m accuracy``: the accuracy dev gate's command line (exit 0 pass / 1 fail / 2 bad input / 130 stopped;
``UsageError`` is printed to stderr as "error: ...", any other ``AccuracyInputError`` as "error: accuracy gate: bad
input: ...")."""

from __future__ import annotations

import importlib.util
import sys

if __name__ == "__main__":  # outside the project's environment: say how to enter it, not a traceback
    _missing = [m for m in ("numpy", "nltk", "rouge_score", "transformers") if importlib.util.find_spec(m) is None]
    if _missing:
        print(f"error: {', '.join(_missing)} not installed for {sys.executable}: run `bash scripts/setup.sh` in the "
              "repository, then `. .venv/bin/activate` (or call `.venv/bin/python -m accuracy ...`)", file=sys.stderr)
        sys.exit(2)

import argparse
import logging
import shlex
import sys
from pathlib import Path

from accuracy.constants import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_PASS
from accuracy.errors import AccuracyInputError, UsageError

log = logging.getLogger("accuracy")


def _eos_list(text: str) -> tuple[int, ...]:
    """``--eos-ids``: comma-separated token ids, each in int32's ``[0, INT32_END)`` (refused here, as a command-line
    error). ``accuracy.tokenizer.resolve_eos_ids`` checks the same range for the ids of the other sources (the run.json
    beside the log, ``generation_config.json``, ``run_gate(eos_ids=...)``), which nothing checks before it; for ids
    given here it never fires.

    Raises:
        argparse.ArgumentTypeError: not integers, none, or one outside that range (naming it).
    """
    from accuracy.tokenizer import INT32_END

    try:
        ids = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--eos-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--eos-ids is empty")
    if min(ids) < 0 or max(ids) >= INT32_END:
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise argparse.ArgumentTypeError(f"--eos-ids are int32 token ids (0 to {INT32_END - 1}), got {bad}")
    return ids


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m accuracy",
        description="MLPerf Llama 3.1 8B accuracy dev gate: check LoadGen's accuracy log, score ROUGE "
        "and gen_len like evaluation.py, compare with the reference. Offline.",
        epilog="Exit status: 0 pass, 1 fail, 2 bad input.",
    )
    p.add_argument("--accuracy-log", required=True, help="RUN_DIR/mlperf_log_accuracy.json (LoadGen AccuracyOnly run)")
    p.add_argument("--dataset", help="cnn_eval.json-format dataset the run used (default: the run.json next to the "
                   "log names it; --tokenizer, --eos-ids and --max-samples then default to the run's too)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer/model folder (tokenizer.json), a tokenizer.json file, or a Llama 3 tiktoken tokenizer.model")
    p.add_argument("--reference", default="auto",
                   help="auto (default: datacenter for 13368 samples, edge for 5000, else datacenter per sample), "
                   "datacenter, edge, or a reference JSON file")
    p.add_argument("--output-dir", default=None, help="where to write accuracy.json etc. (default: the accuracy log's folder)")
    p.add_argument("--eos-ids", type=_eos_list, default=None,
                   help="comma-separated EOS ids, e.g. 128001,128008,128009 (default: generation_config.json next to the tokenizer)")
    p.add_argument("--max-samples", type=_positive, default=None,
                   help="the run used only the first N dataset records (python -m sut run --max-samples N): "
                   "score only those, as the run did")
    p.add_argument("--write-reference", default=None, metavar="FILE",
                   help="also write this run's scores as a reference JSON (usable with --reference FILE)")
    p.add_argument("--clean-up-spaces", choices=("auto", "on", "off"), default="auto",
                   help="transformers-4.x decode clean-up (' .' -> '.' etc.): auto follows the tokenizer config (Llama 3 tiktoken: on)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(eos_source="--eos-ids")  # where --eos-ids came from; _fill_from_run names run.json
    return p


def _without_max_samples(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--max-samples":
            skip = True
        elif not a.startswith("--max-samples="):
            out.append(a)
    return out


def _hint_max_samples(result: dict, args: argparse.Namespace, argv: list[str]) -> None:
    """Say how to score a ``--max-samples`` run when the coverage check fails for want of it."""
    from accuracy.report import run_max_samples, suggested_max_samples

    recorded = run_max_samples(args.accuracy_log)
    k = suggested_max_samples(result.get("checks") or {}, args.max_samples, recorded)
    if k is None:
        return
    why = (f"the run's run.json says it used --max-samples {k}" if recorded is not None else
           f"the log holds exactly the dataset's first {k} samples, as a run made with --max-samples {k} logs them")
    cmd = shlex.join(["python", "-m", "accuracy", *_without_max_samples(argv), "--max-samples", str(k)])
    log.error("hint: %s; score it with the same option (it restricts the dataset to its first %d records, "
              "as the run did):\n  %s", why, k, cmd)


def _run_record(accuracy_log: str) -> dict | None:
    """The ``run.json`` beside ``accuracy_log`` (parsed), or None: no such file, no regular file (a FIFO would block
    the read), unreadable, or not an object (``accuracy.report.run_record_beside``)."""
    from accuracy.report import run_record_beside

    return run_record_beside(accuracy_log)


def _refuse_a_locality_run(args: argparse.Namespace, rec: dict | None) -> None:
    """``UsageError`` before anything is read or written when the log lies in a ``python -m sut.locality`` run
    folder (or below one), the ``run.json`` beside it is a locality record (its marker removed or not), or
    ``--output-dir`` is or lies in such a folder: no gate verdict is written into or for a locality run."""
    from accuracy.loadgen_log import NOT_MLPERF, locality_folder_why, not_mlperf, not_mlperf_kind

    why = locality_folder_why(Path(args.accuracy_log).parent)
    if why:
        raise UsageError(f"--accuracy-log {args.accuracy_log}: its folder {why}")
    if not_mlperf(rec):
        raise UsageError(f"--accuracy-log {args.accuracy_log}: the run.json beside it is a {not_mlperf_kind(rec)} "
                         f"record (python -m sut.locality): {NOT_MLPERF}")
    why = locality_folder_why(Path(args.output_dir)) if args.output_dir else None
    if why:
        raise UsageError(f"--output-dir {args.output_dir} {why}")


def _refuse_a_performance_run(accuracy_log: str, rec: dict | None) -> None:
    """``UsageError`` first, before any question about the dataset or tokenizer, when the ``run.json`` beside the log
    records a performance run (LoadGen logs no answers in performance mode: nothing to score)."""
    if rec is not None and rec.get("mode") == "performance":
        raise UsageError(f"{accuracy_log} belongs to a performance run ({Path(accuracy_log).parent / 'run.json'} mode "
                         "\"performance\"): LoadGen logs no answers in that mode, so there is nothing to score. Score "
                         "an accuracy run's log: python -m sut run --mode accuracy ... (same preset and model)")


def _recorded_tokenizer(rec: dict | None, run_json: Path) -> str | None:
    """The gate tokenizer a harness ``run.json`` (``rec``, read from ``run_json``) records: the run's
    ``--tokenizer``, else its model folder. ``UsageError`` for a value that is not a path (a hand-edited file)."""
    rs, model = (rec or {}).get("run_settings"), (rec or {}).get("model") or {}
    if not isinstance(rs, dict) or not isinstance(model, dict):
        return None
    for field, value in (("run_settings.tokenizer", rs.get("tokenizer")), ("model.path", model.get("path"))):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise UsageError(f"{run_json} {field} is {value!r}, not a path as the harness writes it (was the file "
                             "edited?): pass --tokenizer PATH")
        return value
    return None


def _refuse_a_dataset_without_tokenizer(args: argparse.Namespace, rec: dict | None) -> None:
    """``--dataset`` without ``--tokenizer`` next to a harness run: ``UsageError`` naming the tokenizer its ``run.json``
    records (the run's ``--tokenizer``, else its model folder) and the shorter form; with no such record the gate's
    own "no tokenizer given" error follows."""
    recorded = _recorded_tokenizer(rec, Path(args.accuracy_log).parent / "run.json")
    if recorded:
        raise UsageError(f"--dataset without --tokenizer: the run's {Path(args.accuracy_log).parent / 'run.json'} "
                       f"names its gate tokenizer {recorded}; pass --tokenizer {recorded}, or leave out --dataset to "
                       "take the dataset, tokenizer, EOS ids and --max-samples from that run.json")


def _refuse_a_mismatched_rescore(args: argparse.Namespace, argv: list[str], output_dir: Path,
                                 rec: dict | None) -> None:
    """A re-score that writes into the run's own folder must use the run's dataset and ``--max-samples``
    (its ``run.json``): otherwise its verdict (coverage failures, scores of other samples) would replace the
    run's ``accuracy.json``, which ``python -m sut package`` takes. Raises ``UsageError`` (exit 2, nothing
    written) naming the field and the command to use; no ``run.json`` or an unreadable one: no check."""
    from accuracy.dataset import sha256_file

    run_dir = Path(args.accuracy_log).parent
    try:
        if rec is None or output_dir.resolve() != run_dir.resolve():
            return
        recorded, ds = rec["run_settings"].get("max_samples"), rec.get("dataset")
    except (OSError, KeyError, TypeError, AttributeError):
        return
    recorded = _checked_max_samples(recorded, run_dir / "run.json")
    elsewhere = "or write the results elsewhere with --output-dir DIR"
    if recorded != args.max_samples:
        fixed = _without_max_samples(argv) + ([] if recorded is None else ["--max-samples", str(recorded)])
        raise UsageError(f"{run_dir}/run.json run_settings.max_samples is {recorded}, this command's --max-samples "
                       f"{args.max_samples}: scoring so would replace the run's own accuracy.json with a verdict on "
                       f"other samples. Score it as the run did:\n  {shlex.join(['python', '-m', 'accuracy', *fixed])}"
                       f"\n{elsewhere}")
    want = ds.get("sha256") if isinstance(ds, dict) else None
    if isinstance(want, str) and Path(args.dataset).is_file() and sha256_file(args.dataset) != want:
        raise UsageError(f"--dataset {args.dataset} is not the file the run used ({run_dir}/run.json dataset.path "
                       f"{ds.get('path')}, sha256 {want[:12]}...): scoring it would replace the run's own "
                       f"accuracy.json; pass the run's dataset, {elsewhere}")


def _checked_max_samples(recorded: object, run_json: Path) -> int | None:
    """``run_settings.max_samples`` of a ``run.json`` as the harness writes it: null or a whole number >= 1.
    Raises ``UsageError`` (exit 2, nothing written) for anything else (a hand-edited file)."""
    if recorded is None or (type(recorded) is int and recorded >= 1):
        return recorded
    raise UsageError(f"{run_json} run_settings.max_samples is {recorded!r}, not null or a whole number >= 1 as the "
                   "harness writes it (was the file edited?): fix it, or score elsewhere with --dataset FILE "
                   "--tokenizer PATH [--max-samples N] --output-dir DIR")


def _fill_from_run(args: argparse.Namespace, rec: dict | None) -> None:
    """Without ``--dataset``: the run's dataset, gate tokenizer (``--tokenizer``, else the model folder), model EOS
    ids and ``--max-samples`` from ``rec`` (the ``run.json`` next to the log), each only where the command gave none.
    Raises ``UsageError`` when there is no readable ``run.json`` naming a dataset."""
    run_json = Path(args.accuracy_log).parent / "run.json"
    try:
        dataset = rec["run_settings"]["dataset"]
        if not isinstance(dataset, str) or not dataset:
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise UsageError(f"--dataset is required: {run_json} is missing, unreadable or names no dataset "
                       "(run_settings.dataset); pass --dataset FILE --tokenizer PATH") from None
    args.dataset = dataset
    rs, model = rec["run_settings"], rec.get("model") or {}
    if args.tokenizer is None:
        args.tokenizer = _recorded_tokenizer(rec, run_json)
    eos = model.get("eos_token_ids") if isinstance(model, dict) else None
    if args.eos_ids is None and isinstance(eos, list) and eos and all(type(e) is int for e in eos):
        args.eos_ids, args.eos_source = tuple(eos), f"{run_json} model.eos_token_ids"
    recorded = _checked_max_samples(rs.get("max_samples"), run_json)
    if args.max_samples is None and recorded is not None:
        args.max_samples = recorded
    log.info("from %s: --dataset %s --tokenizer %s%s%s", run_json, args.dataset, args.tokenizer,
             f" --eos-ids {','.join(map(str, args.eos_ids))}" if args.eos_ids else "",
             f" --max-samples {args.max_samples}" if args.max_samples else "")


def _refuse_a_reference_path_that_cannot_be_a_file(path: Path) -> None:
    """``--write-reference`` that could never be written (an existing folder, FIFO or device, or a path under a
    file): ``UsageError`` before the gate writes anything, not after its report is half written."""
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise UsageError(f"--write-reference {path} is " + ("a folder" if path.is_dir() else
                         "not a regular file (a FIFO, device or socket)") + ": name a JSON file to write")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"--write-reference {path}: {blocking} is a file, not a folder")


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s")
    for flag in ("accuracy_log", "dataset", "tokenizer", "reference", "output_dir", "write_reference"):
        value = getattr(args, flag)
        if value is not None and not value.strip():  # '' would be taken for the default or the current folder
            raise UsageError(f"--{flag.replace('_', '-')} {value!r}: an empty value; leave the flag out for its "
                             "default")
    if not Path(args.accuracy_log).is_file():  # before the run.json beside it is looked for
        raise UsageError(f"--accuracy-log {args.accuracy_log}: " + ("not a file" if Path(args.accuracy_log).exists()
                                                                    else "no such file"))
    rec = _run_record(args.accuracy_log)
    _refuse_a_locality_run(args, rec)
    _refuse_a_performance_run(args.accuracy_log, rec)
    if args.dataset is None:
        _fill_from_run(args, rec)
    elif args.tokenizer is None:
        _refuse_a_dataset_without_tokenizer(args, rec)
    from accuracy.gate import GateSettings, evaluate

    acc_log = Path(args.accuracy_log)
    settings = GateSettings(
        accuracy_log=acc_log,
        dataset=Path(args.dataset),
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        output_dir=Path(args.output_dir) if args.output_dir else acc_log.parent,
        reference=args.reference,
        eos_ids=args.eos_ids,
        eos_source=args.eos_source,
        max_samples=args.max_samples,
        clean_up_spaces={"auto": None, "on": True, "off": False}[args.clean_up_spaces],
        write_reference=Path(args.write_reference) if args.write_reference else None,
    )
    _refuse_a_mismatched_rescore(args, argv, settings.output_dir, rec)
    if settings.output_dir.exists() and not settings.output_dir.is_dir():  # found before scoring, not after
        raise UsageError(f"--output-dir {settings.output_dir} is a file, not a folder")
    if settings.write_reference is not None:
        _refuse_a_reference_path_that_cannot_be_a_file(settings.write_reference)
    try:
        result = evaluate(settings)
    except AccuracyInputError:  # exit 2 (main); some are OSErrors too (TokenizerNotFoundError)
        raise
    except OSError as exc:  # e.g. an --output-dir that cannot be written
        raise UsageError(f"accuracy gate: cannot write the results: {exc}") from None
    _hint_max_samples(result, args, argv)
    if settings.write_reference is not None and not result["files"].get("reference_written"):
        return EXIT_FAIL
    return EXIT_PASS if result["passed"] else EXIT_FAIL


def main(argv: list[str] | None = None) -> int:
    """``python -m accuracy``; returns the exit code (0 pass, 1 fail, 2 bad input, 130 stopped)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except UsageError as e:  # bad input: one "error:" line on stderr, as the harness's commands print it
        print(f"error: {e}", file=sys.stderr)
    except AccuracyInputError as e:
        print(f"error: accuracy gate: bad input: {e}", file=sys.stderr)
    except KeyboardInterrupt as e:
        log.error("interrupted (%s)", e.args[0] if e.args else "SIGINT, Ctrl-C")
        return EXIT_INTERRUPTED
    except Exception as e:  # an error class that carries its exit code (the harness's own); others are bugs
        code = getattr(type(e), "exit_code", None)
        if not isinstance(code, int):
            raise
        log.error("accuracy gate: %s", e)
        return code
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
