"""Triton Python-backend model: scores a whole dynamic batch with ONNX Runtime in one call.

Copied as ``model.py`` into the generated model repository and run by Triton's Python backend
stub inside the Triton virtual environment. Requests in one batch are concatenated on the batch
axis; histories of different lengths are zero-padded (mask 0) to the longest in the batch.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

FEATURES, HISTORY, MASK, SCORE = "features", "history", "history_mask", "score"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("intra_op_num_threads", "1"))
        options.inter_op_num_threads = 1
        model_path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(
            model_path, sess_options=options, providers=["CPUExecutionProvider"]
        )

    def execute(self, requests):
        features, histories, masks, sizes = [], [], [], []
        for request in requests:
            features.append(pb_utils.get_input_tensor_by_name(request, FEATURES).as_numpy())
            histories.append(pb_utils.get_input_tensor_by_name(request, HISTORY).as_numpy())
            masks.append(pb_utils.get_input_tensor_by_name(request, MASK).as_numpy())
            sizes.append(features[-1].shape[0])
        length = max(h.shape[1] for h in histories)
        if any(h.shape[1] != length for h in histories):
            histories = [np.pad(h, ((0, 0), (0, length - h.shape[1]), (0, 0))) for h in histories]
            masks = [np.pad(m, ((0, 0), (0, length - m.shape[1]))) for m in masks]
        (scores,) = self.session.run(
            [SCORE],
            {
                FEATURES: np.concatenate(features).astype(np.float32, copy=False),
                HISTORY: np.concatenate(histories).astype(np.float32, copy=False),
                MASK: np.concatenate(masks).astype(np.float32, copy=False),
            },
        )
        responses, start = [], 0
        for size in sizes:
            out = pb_utils.Tensor(SCORE, scores[start : start + size])
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += size
        return responses
