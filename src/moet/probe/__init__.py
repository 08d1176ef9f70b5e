"""Quality probes for moet-tiny (and any DeepSeek-V3-layout checkpoint it fits): held-out code
loss, MTP next-next accuracy, facts, arithmetic, needle retrieval, tool calls, for routed
experts in BF16, NVFP4 and moet's 2-bit W2, run through moet's engine (engine.py). `moet probe`
is the command line (cli.py); loader.py builds transformers' model with the same experts, the
independent reference of the tests.

Task definitions (facts, arithmetic, needle, tools, chat_format, code_data) are shared with
the training recipe in tools/train_tiny, which trains on their training splits.
"""
