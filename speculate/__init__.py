"""qspec's speculators around one verifier: every speculator implements the contract of runtime.speculation
(propose a chain or a candidate tree; verify through speculate.verify, row by row with each row's own
SamplingParams and generator), so the static loop (speculate.generate) and the serving engine run them alike.

Lossless: n-gram (prompt lookup), draft model (layer-skip, quantized self-draft or any same-vocabulary model),
Medusa and EAGLE trees under rejection sampling. APPROXIMATE: Medusa's typical acceptance (named as such).
speculate.registry names them all (and plug-ins: module:attr, or entry points of the group qspec.speculators).
"""

from speculate.base import Speculator, SpeculatorError
from speculate.cli import SPECULATORS, build_speculator
from speculate.draft import DraftModelSpeculator, layer_skip_draft, quantized_draft
from speculate.generate import SpecOutput, SpecStats, speculative_generate
from speculate.medusa.speculator import MedusaSpeculator
from speculate.ngram import NgramSpeculator
from speculate.registry import BuildContext, Method, build, check_method, register, speculator_names
from speculate.verify import rejection_sample, verify_chain, verify_tree

__all__ = [
    "SPECULATORS",
    "BuildContext",
    "DraftModelSpeculator",
    "MedusaSpeculator",
    "Method",
    "NgramSpeculator",
    "SpecOutput",
    "SpecStats",
    "Speculator",
    "SpeculatorError",
    "build",
    "build_speculator",
    "check_method",
    "layer_skip_draft",
    "quantized_draft",
    "register",
    "rejection_sample",
    "speculative_generate",
    "speculator_names",
    "verify_chain",
    "verify_tree",
]
