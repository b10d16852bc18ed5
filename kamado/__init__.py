"""kamado: an LLM inference engine and OpenAI-compatible server for local agent workloads."""

from kamado.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the model code; keep `import kamado` light for the CLI and server.
    if name == "LLM":
        from kamado.engine.llm import LLM

        return LLM
    raise AttributeError(name)
