"""A reader written from scratch that shards its own files across the workers."""

import json
import pathlib
import tempfile

import torch

import aioloader


class JsonFiles(aioloader.Reader):
    manual_multiprocess_sharding = True  # read() splits the work; the loader must not

    def read(self, folder):
        files = sorted(pathlib.Path(folder).glob("*.json"))
        info = aioloader.get_worker_info()  # None in the main process
        if info is not None:
            files = files[info.id :: info.num_workers]  # worker k reads files k, k+n, ...
        for path in files:
            for record in json.loads(path.read_text()):
                yield {"id": record["id"], "features": torch.tensor(record["features"])}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        for f in range(4):  # four files of five records each
            records = [{"id": 5 * f + i, "features": [f, i, 1.0]} for i in range(5)]
            pathlib.Path(folder, f"part-{f}.json").write_text(json.dumps(records))
        loader = aioloader.DataLoader(JsonFiles(), folder, batch_size=4, num_workers=2,
                                      quiet=True)
        seen = []
        for batch in loader:
            print(batch["id"].tolist(), tuple(batch["features"].shape))
            seen += batch["id"].tolist()
        assert sorted(seen) == list(range(20)), seen
        print(f"all {len(seen)} records, each exactly once")
