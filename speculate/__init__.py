"""qspec's speculators around one verifier: every speculator implements the contract of runtime.speculation
(propose a chain or a candidate tree; verify through speculate.verify, row by row with each row's own
SamplingParams and generator), so the static loop (speculate.generate) and the serving engine run them alike.

Lossless: n-gram (prompt lookup), draft model (layer-skip, quantized self-draft or any same-vocabulary model),
Medusa and EAGLE trees under rejection sampling. APPROXIMATE: Medusa's typical acceptance (named as such).
"""

from speculate.base import Speculator, SpeculatorError
from speculate.cli import SPECULATORS, build_speculator
from speculate.draft import DraftModelSpeculator, layer_skip_draft, quantized_draft
from speculate.generate import SpecOutput, SpecStats, speculative_generate
from speculate.medusa.speculator import MedusaSpeculator
from speculate.ngram import NgramSpeculator
from speculate.verify import rejection_sample, verify_chain, verify_tree

__all__ = [
    "SPECULATORS",
    "DraftModelSpeculator",
    "MedusaSpeculator",
    "NgramSpeculator",
    "SpecOutput",
    "SpecStats",
    "Speculator",
    "SpeculatorError",
    "build_speculator",
    "layer_skip_draft",
    "quantized_draft",
    "rejection_sample",
    "speculative_generate",
    "verify_chain",
    "verify_tree",
]
