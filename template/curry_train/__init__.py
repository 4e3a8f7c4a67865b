"""curryTrain: a GPT template with every parallelism primitive, proven against a single-device reference."""
__version__ = "0.1.0"
