"""Real object-store servers on loopback for the checkpoint tests: moto's S3 server (``moto_server``, from
``moto[server]``) and the GCS emulator (``gcp-storage-emulator``). No mock of any client: s3fs and gcsfs talk HTTP to
these processes exactly as they would to the cloud.

Each server keeps its objects in memory; ``stop()`` and ``start()`` on the same port model an outage (the bucket is
created again after a restart, as a real bucket would still exist).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from meshrun.launch.net import free_port  # noqa: F401 - tests import it from here


def wait_for_port(port: int, timeout_s: float = 30.0) -> bool:
    """True once something accepts connections on 127.0.0.1:``port``, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


class Server:
    """One emulator process on 127.0.0.1:<port>, with the environment its client needs."""

    def __init__(self, kind: str, bucket: str = "ckpt"):
        self.kind, self.bucket, self.port = kind, bucket, free_port()
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def available(kind: str) -> str | None:
        """None when the server and the client library are installed, else why not (a true skip reason)."""
        needs = {"s3": ("moto_server", "s3fs"), "gs": ("gcp-storage-emulator", "gcsfs")}[kind]
        if shutil.which(needs[0]) is None:
            return f"{needs[0]} is not installed (pip install 'meshrun[test]')"
        try:
            __import__(needs[1])
        except ImportError:
            return f"{needs[1]} is not installed (pip install 'meshrun[{'s3' if kind == 's3' else 'gcs'}]')"
        return None

    @property
    def env(self) -> dict[str, str]:
        if self.kind == "s3":
            return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": self.url, "AWS_EC2_METADATA_DISABLED": "true"}
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "NO_GCE_CHECK": "true"}

    def start(self) -> None:
        command = (["moto_server", "-H", "127.0.0.1", "-p", str(self.port)] if self.kind == "s3" else
                   ["gcp-storage-emulator", "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"])
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port(self.port):
            self.stop()
            raise RuntimeError(f"{command[0]} did not listen on port {self.port} within 30 s")
        self.make_bucket()

    def make_bucket(self) -> None:
        fs = self.filesystem()
        if self.kind == "s3":
            fs.call_s3("create_bucket", Bucket=self.bucket)  # us-east-1: no location constraint
        else:
            fs.mkdir(self.bucket)

    def filesystem(self, **kwargs):
        """A fresh fsspec client of the server (the test's own, not meshrun's), configured explicitly."""
        import fsspec

        if self.kind == "s3":
            return fsspec.filesystem("s3", skip_instance_cache=True, key="testing", secret="testing",
                                     endpoint_url=self.url, client_kwargs={"region_name": "us-east-1"}, **kwargs)
        from gcsfs.core import GCSFileSystem  # the plain class: the default one probes a control API for a minute

        return GCSFileSystem(skip_instance_cache=True, token="anon", endpoint_url=self.url, **kwargs)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def folder(self, name: str) -> str:
        return f"{self.kind}://{self.bucket}/{name}"
