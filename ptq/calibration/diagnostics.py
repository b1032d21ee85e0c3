"""Per-tensor diagnostics from calibration statistics: each calibrated activation's amax and its
signal-to-quantization-noise ratio (SQNR, dB) under E4M3 and under int8, both with a static
per-tensor max scale (amax / format max), estimated on the calibration histogram. Low SQNR marks the
tensors that lose the most; E4M3's relative precision keeps its SQNR near-constant where int8's
falls with outliers."""

from __future__ import annotations

from ptq.calibration.calibrate import Calibration
from ptq.calibration.observers import sqnr_db
from ptq.models.matmuls import natural_key
from ptq.numerics.formats import get_format

FORMATS = ("e4m3", "int8")


def sqnr_table(calibration: Calibration, top: int = 10) -> dict | None:
    """{"method", "tensors": [{tensor, amax, sqnr_e4m3_db, sqnr_int8_db}], "worst_e4m3",
    "worst_int8"} or None when the calibration has no histograms."""
    rows = []
    # a layer no calibration data reached holds the histogram of the one its amax came from: nothing
    # of its own
    unseen = {u["layer"] for u in calibration.metadata.get("unseen_layers", [])}
    for name, hist in sorted(calibration.input_hist.items(), key=lambda item: natural_key(item[0])):
        if name in unseen:
            continue
        amax = float(calibration.input_amax[name])
        row = {"tensor": name, "amax": amax}
        for fmt in FORMATS:
            db = sqnr_db(hist, amax, get_format(fmt))
            row[f"sqnr_{fmt}_db"] = None if db is None else round(db, 3)
        rows.append(row)
    if not rows:
        return None

    def worst(fmt: str) -> list[str]:
        finite = [r for r in rows if r[f"sqnr_{fmt}_db"] is not None]
        return [r["tensor"] for r in sorted(finite, key=lambda r: r[f"sqnr_{fmt}_db"])[:top]]

    return {
        "method": "static per-tensor max scale; SQNR = 10 log10(E[x^2] / E[(x - Q(x))^2]) on "
        "the calibration histogram of |x|",
        "tensors": rows,
        "worst_e4m3": worst("e4m3"),
        "worst_int8": worst("int8"),
    }
