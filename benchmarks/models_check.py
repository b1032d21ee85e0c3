"""`make models-check`: `ptq compare` (fp8-e4m3 and int8 against bf16) on a tiny random model of every family
tests/families.py builds, dense and mixture-of-experts, each printed with its coverage line. A few minutes."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# Coverage does not depend on the kernels: the eager ones spare compiling for each family's shapes (as in the tests)
os.environ.setdefault("PTQ_COMPILE", "0")
os.environ.setdefault("PTQ_DEVICE", "cpu")

import families  # noqa: E402

from ptq import progress  # noqa: E402
from ptq.commands.compare import run_compare  # noqa: E402
from ptq.commands.options import CalibrationOptions, DataOptions, ModelOptions, OutputOptions  # noqa: E402
from ptq.reporting.coverage import describe_coverage  # noqa: E402
from ptq.reporting.results import to_json  # noqa: E402


def main() -> int:
    from transformers.utils import logging as hf_logging

    progress.QUIET = True
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text(families.TEXT * 3)
        for family in families.FAMILIES:
            directory = Path(tmp) / family
            families.build(family).save_pretrained(directory)
            families.make_tokenizer().save_pretrained(directory)
            try:
                r = run_compare(
                    ["fp8-e4m3", "int8"],
                    model=ModelOptions(model=str(directory)),
                    data=DataOptions(data=str(text), seq_len=32, windows=4),
                    calibration=CalibrationOptions(data=str(text), samples=4, seq_len=32),
                    output=OutputOptions(path=Path(tmp) / f"report-{family}", plots=False),
                )
            except Exception as e:  # noqa: BLE001 - report every family, then fail
                failed.append(family)
                print(f"FAIL  {family:14s} {type(e).__name__}: {e}")
                continue
            v = r.variants[0]
            print(
                f"OK    {family:14s} fp8-e4m3 {v.ppl_delta_pct:+.2f}% ppl; {describe_coverage(to_json(v.coverage))}"
            )
    print(f"{len(families.FAMILIES) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
