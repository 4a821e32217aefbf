"""elastrun_control: the historical name of elastrun.control (the agent -> worker control channel).

    import elastrun_control as ec      # the same module object as `import elastrun.control`

Kept as a thin alias; new code should import elastrun.control. Standard library only.
"""

import os
import sys

try:
    from elastrun import control as _control
except ImportError:
    # A source tree without the built package on the path: python/ is next to launcher/.
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from elastrun import control as _control

sys.modules[__name__] = _control
