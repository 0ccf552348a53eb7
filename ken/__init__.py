"""KEN: semantic SQL served by model cascades.

>>> import ken
>>> session = ken.connect()
>>> session.sql("SELECT 1 + 1 AS two").fetchall()
[(2,)]
"""

from ken.engine.supervision import BatchDeadline
from ken.errors import KenError
from ken.frame import Frame, call, col
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Output
from ken.models.quality import EvalSample
from ken.ops.base import Operator, SemanticFunction
from ken.optimizer.query import QueryPlan, Target
from ken.optimizer.workload import Hardware, Workload
from ken.policy.decoding import ServiceTargets
from ken.policy.plan import Frontier, GearPlan, GenPlan, Plan
from ken.session import Session, connect
from ken.sql.result import Result

__all__ = ["BatchDeadline", "Cascade", "DeviceConfig", "EvalSample", "Frame", "Frontier",
           "GearPlan", "GenPlan", "Hardware", "KenError", "Operator", "Output", "Plan",
           "QueryPlan", "Result", "SemanticFunction", "ServiceTargets", "Session", "Target",
           "Workload", "call", "col", "connect"]
__version__ = "0.1.0"
