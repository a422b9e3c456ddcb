// The engine validates every operation for memory's sake, whatever validated it before:
// the Python communicator checks arguments for the user (clear messages), but a bug there,
// a transport that skips it, or a caller of comm._native must still get an error and never
// a copy past the end of a buffer. Everything here is local: no byte has been sent yet.
// The binding's lean path asks the same question in its EXACT form (check_op) to tell
// whether it can take a call or must leave it to the communicator, which names the problem.
#include <string>

#include "core/op.h"
#include "kernels/reduce.h"

namespace comm {

namespace {

[[noreturn]] void invalid(const std::string& why) { fail(ErrorCode::INVALID_ARGUMENT, -1, why); }

uint64_t times(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) invalid("an element count overflows 64 bits");
  return r;
}

// The buffer at `ptr` of `have` bytes must hold `want` bytes (exactly: be that size).
void fits(const char* what, uintptr_t ptr, uint64_t have, uint64_t want, bool exact) {
  if (want > have || (exact && want != have))
    invalid(std::string("the ") + what + " buffer holds " + std::to_string(have) +
            " bytes but the operation needs " + std::to_string(want));
  if (want > 0 && ptr == 0) invalid(std::string("the ") + what + " buffer is null");
}

void in_group(const char* what, int r, int size) {
  if (r < 0 || r >= size)
    invalid(std::string(what) + " " + std::to_string(r) + " is out of range for a group of " +
            std::to_string(size));
}

// Bytes of a packed all_to_all buffer; `what` names the splits in messages.
uint64_t split_bytes(const std::vector<uint64_t>& counts, int size, uint64_t elem, const char* what) {
  if (counts.size() != static_cast<size_t>(size))
    invalid(std::string(what) + " has " + std::to_string(counts.size()) + " entries for a group of " +
            std::to_string(size));
  uint64_t total = 0;
  for (uint64_t c : counts)
    if (__builtin_add_overflow(total, times(c, elem), &total)) invalid(std::string(what) + " overflow 64 bits");
  return total;
}

// Whether the input and output share memory other than in the operation's in-place layout
// (the output itself for all_reduce; this rank's block for the gathers and scatters; none
// for the others).
bool overlaps(const OpArgs& a, int rank) {
  if (!a.send_bytes || !a.recv_bytes || a.send + a.send_bytes <= a.recv || a.recv + a.recv_bytes <= a.send)
    return false;
  uint64_t at = 0;  // this rank's block in the v-collectives
  for (int q = 0; q < rank && q < static_cast<int>(a.recv_counts.size()); q++) at += a.recv_counts[q];
  at *= itemsize(a.dtype);
  switch (a.kind) {
    case OpKind::ALL_REDUCE: return a.send != a.recv;
    case OpKind::ALL_GATHER: return a.send != a.recv + rank * a.send_bytes;
    case OpKind::ALL_GATHER_V: return a.send != a.recv + at;
    case OpKind::REDUCE_SCATTER: return a.recv != a.send + rank * a.recv_bytes;
    case OpKind::REDUCE_SCATTER_V: return a.recv != a.send + at;
    default: return true;
  }
}

}  // namespace

void check_codes(int kind, int dtype, int op) {
  if (kind < 0 || kind >= static_cast<int>(OpKind::COUNT)) invalid("unknown operation code " + std::to_string(kind));
  if (dtype < 0 || dtype >= static_cast<int>(DType::COUNT)) invalid("unknown dtype code " + std::to_string(dtype));
  if (op < 0 || op >= static_cast<int>(ReduceOp::COUNT)) invalid("unknown reduce op code " + std::to_string(op));
}

void validate(const OpArgs& a, int rank, int size) { check_op(a, rank, size, Fit::AT_LEAST); }

void check_op(const OpArgs& a, int rank, int size, Fit fit) {
  const bool exact = fit == Fit::EXACT;
  check_codes(static_cast<int>(a.kind), static_cast<int>(a.dtype), static_cast<int>(a.op));
  const uint64_t elem = itemsize(a.dtype);
  const uint64_t block = times(a.count, elem);  // one rank's share, for every kind but all_to_all
  const uint64_t all = times(block, static_cast<uint64_t>(size));
  const bool root = rank == a.root;
  if (a.wire != Wire::EXACT) {  // compressed: float32 all_reduce, reduce_scatter, all_gather (twolevel_compress.cc)
    if (static_cast<int>(a.wire) >= static_cast<int>(Wire::COUNT))
      invalid("wire format code " + std::to_string(static_cast<int>(a.wire)) + " is unknown");
    const bool gathers = a.kind == OpKind::ALL_GATHER || a.kind == OpKind::ALL_GATHER_V;
    if ((a.kind != OpKind::ALL_REDUCE && a.kind != OpKind::REDUCE_SCATTER && a.kind != OpKind::REDUCE_SCATTER_V &&
         !gathers) || a.dtype != DType::F32)
      invalid("a compressed wire format needs float32 data in an all_reduce, reduce_scatter or all_gather "
              "(or a v form)");
    if (!gathers && a.op != ReduceOp::SUM && a.op != ReduceOp::AVG && a.op != ReduceOp::PREMUL_SUM)
      invalid("a compressed wire format sums: the op must be SUM, AVG or PREMUL_SUM");
    if (a.wire == Wire::FP8 && (a.wire_block == 0 || a.wire_block > (1u << 24)))
      invalid("the fp8 scale block must hold 1 to 2^24 elements, not " + std::to_string(a.wire_block));
  }
  switch (a.kind) {
    case OpKind::ALL_REDUCE:
    case OpKind::REDUCE_SCATTER:
    case OpKind::REDUCE_SCATTER_V:
    case OpKind::REDUCE:
      if (!reduce_fn(a.dtype, a.op))
        invalid("reduce op code " + std::to_string(static_cast<int>(a.op)) +
                " is not defined for dtype code " + std::to_string(static_cast<int>(a.dtype)));
      break;
    default: break;
  }
  switch (a.kind) {
    case OpKind::ALL_REDUCE:
      fits("input", a.send, a.send_bytes, block, exact);
      fits("output", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::REDUCE_SCATTER:
      fits("input", a.send, a.send_bytes, all, exact);
      fits("output", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::ALL_GATHER:
      fits("input", a.send, a.send_bytes, block, exact);
      fits("output", a.recv, a.recv_bytes, all, exact);
      break;
    case OpKind::BROADCAST:  // one buffer, sent from the root and received elsewhere
      in_group("root", a.root, size);
      fits("broadcast", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::REDUCE:
      in_group("root", a.root, size);
      fits("input", a.send, a.send_bytes, block, exact);
      if (root) fits("output", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::GATHER:
      in_group("root", a.root, size);
      fits("input", a.send, a.send_bytes, block, exact);
      if (root) fits("output", a.recv, a.recv_bytes, all, exact);
      break;
    case OpKind::SCATTER:
      in_group("root", a.root, size);
      if (root) fits("input", a.send, a.send_bytes, all, exact);
      fits("output", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::ALL_TO_ALL: {
      fits("input", a.send, a.send_bytes, split_bytes(a.send_counts, size, elem, "in_splits"), exact);
      fits("output", a.recv, a.recv_bytes, split_bytes(a.recv_counts, size, elem, "out_splits"), exact);
      // The block a rank keeps is copied from its input slot into its output slot.
      if (a.send_counts[rank] != a.recv_counts[rank])
        invalid("this rank sends itself " + std::to_string(a.send_counts[rank]) +
                " elements (in_splits[" + std::to_string(rank) + "]) but expects " +
                std::to_string(a.recv_counts[rank]) + " (out_splits[" + std::to_string(rank) +
                "]): the two must be equal");
      break;
    }
    case OpKind::ALL_GATHER_V:
    case OpKind::REDUCE_SCATTER_V: {
      // counts[r]: the elements of rank r's block, alike on every rank (the algorithms check
      // that across ranks before a payload byte moves). count is this rank's own block.
      const uint64_t total = split_bytes(a.recv_counts, size, elem, "counts");
      if (a.count != a.recv_counts[rank])
        invalid("count " + std::to_string(a.count) + " differs from counts[" + std::to_string(rank) +
                "] = " + std::to_string(a.recv_counts[rank]));
      const bool gathers = a.kind == OpKind::ALL_GATHER_V;
      fits("input", a.send, a.send_bytes, gathers ? block : total, exact);
      fits("output", a.recv, a.recv_bytes, gathers ? total : block, exact);
      break;
    }
    case OpKind::SEND:
    case OpKind::RECV:
      if (a.kind == OpKind::SEND || a.peer != -1)  // a receive's -1: from any rank
        in_group(a.kind == OpKind::SEND ? "dst" : "src", a.peer, size);
      if (a.peer == rank) invalid("cannot send to or receive from itself");
      if (a.tag < 0) invalid("tag " + std::to_string(a.tag) + " is negative");
      if (a.kind == OpKind::SEND) fits("send", a.send, a.send_bytes, block, exact);
      else fits("receive", a.recv, a.recv_bytes, block, exact);
      break;
    case OpKind::BARRIER:
    case OpKind::COUNT: break;
  }
  // A broadcast's one buffer is both: only the others can overlap.
  if (exact && a.kind != OpKind::BROADCAST && overlaps(a, rank))
    invalid("the input and output share memory other than in the operation's in-place layout");
}

}  // namespace comm
