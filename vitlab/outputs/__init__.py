"""Where vitlab writes: files (atomic writes, tables, safetensors), TensorBoard (writer, steps, scalars, images)
and figures (the figure kinds and the store that redraws them).

``files`` and ``figures`` import no torch at module level: the figure worker process imports ``figures`` only.
"""
