import subprocess
import sys

PLAIN_MODULES = [
    "datamodules.targets", "lti.inverters", "datamodules.metrics", "lti.loss", "datamodules.registry",
    "datamodules.federated", "datamodules.text", "datamodules.targets.vision", "datamodules.vision",
    "exact", "exact.dager", "exact.spear", "lti.matrix",
]


def test_plain_pytorch_parts_do_not_import_lightning():
    code = "import sys\n" + "".join(f"import {m}\n" for m in PLAIN_MODULES) + (
        "bad = [m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
