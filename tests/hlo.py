"""Reading a compiled XLA program's text (`jax.jit(...).lower(...).compile().as_text()`):
the entry computation's instructions, which cache buffers its outputs alias, and which
whole copies of a buffer it makes."""
import re


def hlo_shape(array):
    """An array's type as HLO text writes it, e.g. f32[5,2,128,128]."""
    dtype = {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}[array.dtype.name]
    return f"{dtype}[{','.join(map(str, array.shape))}]"


def entry(compiled_text):
    """The entry computation's instructions: (result type, opcode, operands) triples."""
    body = compiled_text[compiled_text.index("\nENTRY"):]
    return re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} ([\w-]+)\((.*?)\)", body)


def aliased(compiled_text, array, output):
    """Whether output number `output` of the module aliases the parameter of `array`'s
    type (the test's shapes make every cache type unique)."""
    parameter = [operands for type_, op, operands in entry(compiled_text)
                 if op == "parameter" and type_ == hlo_shape(array)]
    aliases = dict(re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)",
                              compiled_text.split("\n", 1)[0]))
    return len(parameter) == 1 and aliases.get(str(output)) == parameter[0]


def whole_copies(compiled_text, array):
    """Entry instructions that copy `array`'s whole buffer, or hold all of it in another
    dtype (a converted copy, or a materialized bitcast to other bits)."""
    dims = hlo_shape(array)[hlo_shape(array).index("["):]
    return [(type_, op) for type_, op, _ in entry(compiled_text)
            if type_.endswith(dims) and type_ != hlo_shape(array) or
            type_ == hlo_shape(array) and op.startswith("copy")]
