"""numba's option for kernels compiled without reference counting (shared by the draft and controller kernels)."""
from __future__ import annotations

from numba.core import cgutils, types
from numba.extending import intrinsic


def _no_refcount() -> dict:
    """numba's option for a kernel compiled without reference counting, where this numba has it (a private option,
    ``_nrt``, of every numba this project supports; should a later one drop it, the kernel compiles as usual).

    Such a kernel, and every kernel it calls (they inherit the option), must allocate nothing: the arrays it gets,
    reads out of a bundle or slices are borrowed from its caller, which keeps them alive for the call."""
    try:
        from numba.core.cpu import CPUTargetOptions
    except ImportError:
        return {}
    return {"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {}


NO_REFCOUNT = _no_refcount()


def _borrowed_getitem():
    """numba's intrinsic that reads a typed List's item without a new reference (internal, of every numba this
    project supports); None where it is gone."""
    try:
        from numba.typed.listobject import _list_getitem_borrowed
    except ImportError:
        return None
    return _list_getitem_borrowed if hasattr(_list_getitem_borrowed, "_defn") else None


_GETITEM = _borrowed_getitem()
if _GETITEM is None:  # without it a kernel without reference counting could not read the histories
    NO_REFCOUNT = {}
# for such a kernel that takes a typed List: numba's Python entry point would need reference counting to take one
# (the kernel is for compiled callers only)
NO_REFCOUNT_LIST = {**NO_REFCOUNT, "no_cpython_wrapper": True} if NO_REFCOUNT else {}
# for a kernel that allocates and may be called from one without: reference counting of its own, not inherited
REFCOUNT = {"_nrt": True} if NO_REFCOUNT else {}


@intrinsic
def list_item(typingctx, lst, index):
    """``lst[index]`` of a typed List of arrays, for a valid non-negative ``index`` (unchecked), also in a kernel
    compiled without reference counting (numba's ``getitem`` is a function that returns an array it was not given,
    which such a kernel cannot call): the item read in place, with a new reference only where the kernel counts
    references."""
    sig = lst.item_type(lst, index)

    def codegen(context, builder, sig, args):
        l_ty, i_ty = sig.args
        lst_v, i = args
        gsig, fn = _GETITEM._defn(context.typing_context, l_ty, types.intp)
        status_item = fn(context, builder, gsig, (lst_v, context.cast(builder, i, i_ty, types.intp)))
        _, item = cgutils.unpack_tuple(builder, status_item)
        out = context.cast(builder, item, gsig.return_type[1], l_ty.item_type)
        if context.enable_nrt:
            context.nrt.incref(builder, l_ty.item_type, out)
        return out

    return sig, codegen


def _meminfo_struct():
    """The LLVM type of numba's MemInfo (internal, of every numba this project supports); None where it is gone."""
    try:
        from numba.core.runtime.nrtdynmod import _meminfo_struct_type
    except ImportError:
        return None
    return _meminfo_struct_type


_MEMINFO = _meminfo_struct()
if _MEMINFO is None:  # without it a kernel without reference counting could not read a StructRef's fields
    NO_REFCOUNT = NO_REFCOUNT_LIST = REFCOUNT = {}


@intrinsic(prefer_literal=True)
def field(typingctx, ref, name):
    """``ref.<name>`` of a StructRef ``ref`` (``name`` a string constant), also in a kernel compiled without
    reference counting (numba's attribute access needs it): the field read in place, with a new reference only
    where the kernel counts references."""
    if not isinstance(name, types.StringLiteral) or not isinstance(ref, types.StructRef):
        return None
    attr = name.literal_value
    fty = ref.field_dict[attr]
    sig = fty(ref, name)

    def codegen(context, builder, sig, args):
        ref_ty = sig.args[0]
        mi = cgutils.create_struct_proxy(ref_ty)(context, builder, value=args[0]).meminfo
        if context.enable_nrt:
            data = context.nrt.meminfo_data(builder, mi)
        else:  # what NRT_MemInfo_data_fast does
            data = builder.load(cgutils.gep(builder, builder.bitcast(mi, _MEMINFO.as_pointer()), 0, 3))
        valtype = ref_ty.get_data_type()
        ptr = builder.bitcast(data, context.data_model_manager[valtype].get_value_type().as_pointer())
        out = getattr(cgutils.create_struct_proxy(valtype)(context, builder, ref=ptr), attr)
        if context.enable_nrt:
            context.nrt.incref(builder, fty, out)
        return out

    return sig, codegen
