"""An offloading spec that lets vLLM's scheduler-side CPU offloading run on the CPU build.

vLLM 0.32.0's CPU build refuses CPU offloading ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs") because its transfer worker uses CUDA streams and events. This spec
keeps everything of ``CPUOffloadingSpec`` (chunk sizing, the CPU manager and its LRU, the event
tracker that publishes ``medium "CPU"`` KV events) and replaces only the worker with one that
copies nothing and reports every transfer finished at once. With ``--load-format dummy`` the KV
contents carry no meaning anyway; every event is produced by vLLM's own scheduler code.

Loaded by vLLM itself, never by kvrouter: tests/real_vllm_models.py puts this directory on
``PYTHONPATH`` and passes ``"spec_name": "StubCPUOffloadingSpec", "spec_module_path":
"cpu_stub_spec"`` in ``kv_connector_extra_config``.
"""

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class _NoCopyWorker(OffloadingWorker):
    def __init__(self) -> None:
        self._done: list[TransferResult] = []

    def _finish(self, job_id: int) -> bool:
        self._done.append(
            TransferResult(job_id=job_id, success=True, transfer_size=0, transfer_time=0.0)
        )
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._finish(job_id)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._finish(job_id)

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids) -> None:
        return None


class StubCPUOffloadingSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches) -> OffloadingWorker:
        if getattr(self, "_stub_worker", None) is None:
            self._stub_worker = _NoCopyWorker()
        return self._stub_worker
