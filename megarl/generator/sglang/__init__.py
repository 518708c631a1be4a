"""The SGLang generator backend (GPU; ``pip install -e .[gpu]``).

``protocol``        request bodies and response parsing of SGLang 0.5.x's HTTP API (pure Python)
``http_backend``    SglangBackend: megarl's GeneratorBackend over one SGLang server per replica
``worker_receiver`` the custom weight loader that runs megarl's shard-to-shard receiver inside
                    each SGLang TP worker (SGLang is imported only there, lazily)
``serving``         the model directory and server arguments for block-fp8 serving
"""
