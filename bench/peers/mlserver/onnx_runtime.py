"""MLServer custom runtime: ONNX Runtime on CPU over whatever batch MLServer hands it.

With adaptive batching (``max_batch_size``, ``max_batch_time`` in model-settings.json) MLServer
concatenates queued requests on the first axis before ``predict`` and splits the outputs after,
so one ``predict`` is one ONNX Runtime call per batch. Runs inside the MLServer environment.
"""

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxBatchModel(MLModel):
    async def load(self) -> bool:
        extra = (self.settings.parameters.extra or {}) if self.settings.parameters else {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(extra.get("intra_op_num_threads", 1))
        options.inter_op_num_threads = 1
        self._output = str(extra.get("output", "score"))
        self._session = ort.InferenceSession(
            await get_model_uri(self.settings),
            sess_options=options,
            providers=["CPUExecutionProvider"],
        )
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {
            tensor.name: NumpyCodec.decode_input(tensor).astype(np.float32, copy=False)
            for tensor in payload.inputs
        }
        # A short CPU-bound call; run inline as a typical custom runtime does.
        (scores,) = self._session.run([self._output], feeds)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[NumpyCodec.encode_output(self._output, scores)],
        )
