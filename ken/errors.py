"""One exception hierarchy for the whole package: every error a user can see is a KenError."""

from __future__ import annotations


class KenError(Exception):
    """Base class of every error KEN raises on purpose; the message says what to do."""


class ModelError(KenError):
    """A model could not be prepared, loaded or run."""


class DataError(KenError):
    """Input data is missing or has the wrong shape or type."""


class ProfileError(KenError):
    """A profile is missing, stale or inconsistent with what it is used for."""


class DeviceProfileError(ProfileError):
    """An operator's models cannot be profiled on the device a plan asks for (e.g. a user's
    loaded models, asked for on a GPU)."""


class CascadeError(KenError):
    """A cascade is malformed or does not match the models/profiles given."""


class GuaranteeError(KenError):
    """A statistical target (accuracy, precision or recall against an oracle) is malformed or
    cannot be checked with the data given (``ken.optimizer.guarantee``)."""


class EngineBusy(KenError):
    """The online engine rejected or failed rows of a query (overload, model failure)."""


class ModelCallFailed(EngineBusy):
    """The served model itself failed on rows of a query (it raised, crashed or hung through
    the engine's retries): a fault of the model, not of the load."""


class RequestDropped(EngineBusy):
    """The online engine dropped a row of a query: it could no longer make the end-to-end
    deadline it carried (``ken.engine.deadlines.within``); the message says where and why."""


class ServingStopped(EngineBusy):
    """The online engine shut down (``stop_serving``, the session's close, SIGTERM) before it
    ran rows of a query: nothing was answered for them."""


class ShuttingDown(KenError):
    """The session is shutting down (the process got SIGTERM): it takes no more statements,
    and a statement still running at the end of the drain was interrupted."""


class SqlError(KenError):
    """The query is not valid SQL, or uses a function wrongly."""


class PlanError(KenError):
    """A gear plan or frontier is malformed, or a JSON file holds something else."""


class PolicyError(KenError):
    """A request or batch handed to the dispatcher is not one it knows."""


class WorkerError(KenError):
    """A batch could not run on its device (the model raised, or the worker died)."""


class WorkerDied(WorkerError):
    """The worker process ended while it ran a batch; a fresh one has been started."""


class EngineError(KenError):
    """The engine cannot serve this plan (e.g. a model is missing) or is not running."""


class SimulationError(KenError):
    """A plan cannot be simulated with the given catalog (e.g. a model without a profile)."""


class QueryPlanError(KenError):
    """No combination of gear plans meets the query's target."""


class PlanningError(KenError):
    """The scheduler's input is malformed (e.g. a model with demand but no replica)."""


class WorkloadError(KenError):
    """A hardware description, trace or workload is malformed or missing."""


class UsageError(KenError):
    """The command line or a call's arguments are malformed (the CLI exits with code 2)."""


class StoreError(ModelError):
    """A file of the model store (``KEN_HOME``) is missing, unreadable or differs from what
    was written; the message names the file and the command that repairs it."""


class BatchTimeout(WorkerError):
    """A batch ran past its deadline; its worker was stopped and replaced."""
