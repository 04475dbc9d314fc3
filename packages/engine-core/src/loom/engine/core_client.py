"""The connection of the front end's ``EngineClient`` to the engine-core *process*.

Requests go to ``engine_core`` as ADD_REQUEST/ABORT frames through the supervisor; a
reader thread takes the frames that come back: OUTPUTS (routed to the request streams),
ENGINE_READY, SHUTDOWN (drain) and PEER_DIED. When the supervisor reports a dead process
or goes away, every request in flight ends with ``EngineDeadError`` naming the process and
the cause, and ``/health`` answers 503 from then on.
"""

from __future__ import annotations

from ..ipc.channel import Channel
from ..ipc.messages import AbortRequests, AddRequest, EngineOutputs, EngineReady, Kind, Shutdown
from ..logger import init_logger
from .client import CoreConnection, EngineClient

logger = init_logger(__name__)


class ProcCoreConnection(CoreConnection):
    thread_name = "loom-core-client"

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def add_request(self, request: AddRequest) -> None:
        self.channel.send("engine_core", request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.channel.send("engine_core", AbortRequests(request_ids=request_ids))

    async def shutdown(self) -> None:
        """Nothing to stop here: the supervisor stops the engine-core process after the front end."""

    def _run(self, client: EngineClient) -> None:
        try:
            while True:
                msg = self.channel.recv()
                if msg is None:
                    continue
                body = msg.body
                if isinstance(body, EngineOutputs):
                    client.on_outputs(body)
                elif isinstance(body, EngineReady):
                    client.on_engine_ready()
                elif msg.kind is Kind.PEER_DIED:
                    client.on_engine_dead(body.describe() if body is not None else
                                          "a process of the serve died (its report did not decode; see the log)")
                elif isinstance(body, Shutdown):
                    client.on_shutdown_requested()
                else:
                    logger.warning("Front end ignored a %s frame from %s", msg.kind.value, msg.src)
        except (EOFError, OSError) as e:
            client.on_engine_dead(f"the supervisor connection closed ({type(e).__name__}: {e})")
        except Exception as e:  # a bug here must not leave the front end waiting on a silent engine
            logger.exception("The front end's engine reader failed")
            client.on_engine_dead(f"the front end's engine reader failed: {type(e).__name__}: {e}")
