"""`from skistune.runtime import Runtime` works (the README's API), and loads torch only then: the simulator
imports the package's torch-free half."""
import subprocess
import sys


def test_runtime_is_importable_from_the_package_and_torch_loads_only_with_it():
    code = ("import sys; import skistune.runtime, skistune.simulator; before = 'torch' in sys.modules; "
            "from skistune.runtime import Runtime; print(before, 'torch' in sys.modules, Runtime.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "Runtime"]
