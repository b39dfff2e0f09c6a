"""Run under a 64 MB /dev/shm: aioloader (memfd arena) vs torch's DataLoader (/dev/shm).

Prints one JSON line: what each loader did.
"""

import json
import os
import threading

import torch
import victims

import aioloader

N, MB = 8, 25  # batch_size 2: 50 MB batches


def run_aioloader() -> dict[str, object]:
    loader = aioloader.DataLoader(victims.BigBatches(N, MB), batch_size=2, num_workers=2,
                                  max_instances_in_memory=2, quiet=True)
    seen = []
    for batch in loader:
        assert batch["x"].shape == (2, MB << 20)
        for i, row in zip(batch["index"].tolist(), batch["x"], strict=True):
            assert int(row[0]) == i % 251 and int(row[-1]) == i % 251
            seen.append(i)
    return {"ok": sorted(seen) == list(range(N)), "batches": len(seen) // 2,
            "batch_mb": 2 * MB}


def run_torch() -> dict[str, object]:
    out: dict[str, object] = {}

    def go() -> None:
        try:
            loader = torch.utils.data.DataLoader(victims.BigDataset(N, MB), batch_size=2,
                                                 num_workers=2)
            out["batches"] = sum(1 for _ in loader)
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - we report whatever torch did
            out["ok"] = False
            text = f"{type(exc).__name__}: {exc}".strip()
            out["error"] = text if len(text) < 700 else text[:200] + " [...] " + text[-450:]

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(90)
    if thread.is_alive():
        out["ok"] = False
        out["error"] = "hung for 90 s"
    return out


def main() -> None:
    st = os.statvfs("/dev/shm")
    result = {"shm_mb": st.f_blocks * st.f_frsize >> 20, "aioloader": run_aioloader()}
    print(json.dumps(result), flush=True)
    result["torch"] = run_torch()
    print(json.dumps(result), flush=True)
    os._exit(0)  # torch's workers may be wedged on a bus error; do not wait for them


if __name__ == "__main__":
    main()
