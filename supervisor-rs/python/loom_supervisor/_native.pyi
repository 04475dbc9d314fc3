# Hand-written stub for the PyO3 module built from supervisor-rs/src/python.rs.
__all__ = [
    "PlanError",
    "SetupError",
    "SpawnError",
    "SupervisorError",
    "WIRE_VERSION",
    "__version__",
    "main",
    "run",
]

WIRE_VERSION: int
__version__: str

class SupervisorError(Exception): ...
class PlanError(SupervisorError): ...
class SpawnError(SupervisorError): ...
class SetupError(SupervisorError): ...

def run(plan: bytes) -> int: ...
def main(argv: list[str], default_python: str | None = None) -> int: ...
