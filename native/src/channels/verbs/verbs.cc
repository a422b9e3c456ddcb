// The verbs net: one RC queue pair per peer and stream, carrying the engine's framed byte
// stream (header + payload, what a TCP socket carries) in credit-controlled slots written
// by RDMA WRITE WITH IMMEDIATE (verbs_wire.h has the format). Built only where rdma-core's
// headers are present (COMM_HAVE_VERBS); libibverbs itself is loaded at run time.
//
// Why a C++ net over libibverbs and not the pyverbs code behind an adapter: the engine's
// algorithms call Channel::progress() from its own threads at microsecond granularity; a
// Python channel would take the GIL per call and bring back the per-chunk Python cost this
// engine exists to remove. Why dlopen and not link: the extension must still import (and run
// shared memory, TCP and UCX) on machines without rdma-core, as NCCL's ibvwrap does.
//
// Why slots and copies rather than zero-copy writes into user buffers: the engine works on
// host memory whose lifetime it does not track past an operation. A cached registration of
// memory that is freed and mapped again at the same address keeps pointing at the old pages
// (silent wrong data), and registering per operation costs more than the copy for all but
// the largest messages. The sender copies into a registered staging slot and the receiver
// out of its registered ring (NCCL's net transport does the same with its FIFO buffers);
// both copies run at memory bandwidth, above a 100 Gb/s port.
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <random>

#include "channels/net.h"
#include "channels/verbs/verbs_ibv.h"
#include "channels/verbs/verbs_wire.h"
#include "windows/window_verbs.h"
#include "windows/window_verbs_plan.h"

namespace comm::verbs {

// ---- one queue pair: the engine's byte stream to one peer ---------------------------------------
class VerbsChannel final : public Channel {
 public:
  // rma: the net's windows, which post RDMA WRITE / READ on this queue pair (the p2p stream's;
  // else null): its queues hold VerbsRmaHub::kDepth more, and their completions go there.
  VerbsChannel(std::shared_ptr<Device> dev, int peer, uint32_t slots, uint32_t slot_bytes,
               std::shared_ptr<VerbsRmaHub> rma);
  ~VerbsChannel() override;
  QpEntry entry() const { return {qp_->qp_num, psn_, reinterpret_cast<uintptr_t>(ring_.base()), ring_.rkey()}; }
  void connect(const PortInfo& port, const Address& remote, const QpEntry& theirs, int hop_limit);
  bool progress(Transfer& t) override;
  // Right before the engine sleeps in poll(): consume the events delivered, arm the queue,
  // and look once more, since a completion that came before the arming raises no event.
  // What that look finds is kept for the next progress(). True: do not sleep.
  bool ready(const Transfer&) const override;
  const std::vector<int>& sockets() const override { return fds_; }
  // The completion channel only ever becomes readable; a send waits for completions too.
  short poll_events(bool) const override { return POLLIN; }
  // RDMA writes land without a system call: spin and yield before sleeping on the channel.
  bool polled() const override { return true; }
  void shutdown() override;

 private:
  enum : uint64_t { WR_DATA = 1, WR_CREDIT = 2 };
  bool poll_cq();
  void on_completion(const ibv_wc& wc);
  bool send(Transfer& t);
  bool recv(Transfer& t);
  void post_write(const char* local, uint32_t len, uint64_t remote, uint32_t imm, uint64_t wr_id);
  void post_recv();
  void return_credits();
  [[noreturn]] void lost(const std::string& what) const;
  void destroy();

  std::shared_ptr<Device> dev_;
  std::shared_ptr<VerbsRmaHub> rma_;
  const uint32_t slots_, slot_bytes_, depth_;  // depth_: the channel's work requests per queue
  ibv_comp_channel* events_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_;
  Region ring_;     // the peer writes slot k mod slots_ here
  Region staging_;  // our copies of the slots we write into the peer's ring
  uint64_t remote_ring_ = 0;
  uint32_t remote_rkey_ = 0;
  CreditWindow window_;
  uint64_t sent_ = 0, sent_done_ = 0;  // DATA writes posted / completed (frees staging slots)
  uint32_t sq_busy_ = 0;               // send work requests not yet completed
  std::deque<uint32_t> arrived_;       // bytes in each filled ring slot, oldest first
  uint64_t read_slot_ = 0;             // ring slot at arrived_.front()
  uint32_t read_off_ = 0;              // bytes of it already consumed
  // Waiting (ready() is const to the engine; these are the completion channel's state).
  mutable std::vector<ibv_wc> stash_;  // completions ready() polled, handled by progress()
  mutable bool armed_ = false;         // a notification was requested and has not fired
  mutable unsigned unacked_events_ = 0;
  std::vector<int> fds_;
};

VerbsChannel::VerbsChannel(std::shared_ptr<Device> dev, int peer, uint32_t slots, uint32_t slot_bytes,
                           std::shared_ptr<VerbsRmaHub> rma)
    : Channel(peer),
      dev_(std::move(dev)),
      rma_(std::move(rma)),
      slots_(slots),
      slot_bytes_(slot_bytes),
      depth_(slots + kCreditReserve),
      psn_(std::random_device{}() & 0xffffff),
      ring_(*dev_, size_t{slots} * slot_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE),
      staging_(*dev_, size_t{slots} * slot_bytes, IBV_ACCESS_LOCAL_WRITE),
      window_(slots) {
  try {
    events_ = lib().create_comp_channel(dev_->ctx);
    if (!events_) fail_errno("ibv_create_comp_channel");
    const int flags = fcntl(events_->fd, F_GETFL);
    if (flags < 0 || fcntl(events_->fd, F_SETFL, flags | O_NONBLOCK) < 0) fail_errno("fcntl(O_NONBLOCK)");
    fds_.push_back(events_->fd);
    const uint32_t rma_depth = rma_ ? VerbsRmaHub::kDepth : 0;
    cq_ = lib().create_cq(dev_->ctx, static_cast<int>(2 * depth_ + rma_depth), nullptr, events_, 0);
    if (!cq_) fail_errno("ibv_create_cq");
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = depth_ + rma_depth;
    init.cap.max_recv_wr = depth_;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.sq_sig_all = 1;  // every write completes: a DATA (or RMA) completion frees its staging slot
    qp_ = lib().create_qp(dev_->pd, &init);
    if (!qp_) fail_errno("ibv_create_qp");
  } catch (...) {
    destroy();
    throw;
  }
}

VerbsChannel::~VerbsChannel() { destroy(); }

// Queue pair before its completion queue, every event acknowledged before the queue goes
// (ibv_destroy_cq waits for that), the completion channel last. Windows stop posting on the
// queue pair before it goes, and learn afterwards that what was in flight on it is over.
void VerbsChannel::destroy() {
  if (qp_ && rma_) rma_->detach(peer_);
  if (qp_) lib().destroy_qp(qp_);
  if (qp_ && rma_) rma_->detached(peer_);
  if (cq_) {
    lib().ack_cq_events(cq_, unacked_events_);
    lib().destroy_cq(cq_);
  }
  if (events_) lib().destroy_comp_channel(events_);
  qp_ = nullptr;
  cq_ = nullptr;
  events_ = nullptr;
}

void VerbsChannel::lost(const std::string& what) const {
  fail(ErrorCode::PEER_FAILURE, peer_,
       "RDMA connection to rank " + std::to_string(peer_) + " failed (" + what +
           "): the peer process died, closed its communicator, or the fabric dropped it");
}

// RESET -> INIT -> RTR -> RTS (ibv_modify_qp(3): each transition's required attributes).
// Receive requests are posted in INIT, before the peer can write: the caller then waits at a
// store barrier until every rank's queue pairs are ready.
void VerbsChannel::connect(const PortInfo& port, const Address& remote, const QpEntry& theirs, int hop_limit) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(port.port);
  // REMOTE_READ: the peer's windows RDMA READ this rank's (window_verbs.cc) on the p2p pair.
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | (rma_ ? IBV_ACCESS_REMOTE_READ : 0);
  if (int rc = lib().modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    fail(ErrorCode::SYSTEM, peer_, std::string("ibv_modify_qp(INIT): ") + std::strerror(rc));
  for (uint32_t i = 0; i < depth_; i++) post_recv();

  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min(port.mtu, remote.mtu));
  a.dest_qp_num = theirs.qpn;
  a.rq_psn = theirs.psn;
  // RDMA READs of the peer's windows served at once (> 0 for any; what our address published).
  a.max_dest_rd_atomic = responder_resources(dev_->max_qp_rd_atom);
  a.min_rnr_timer = 12;  // 0.64 ms; credits keep receive requests posted, so RNR means trouble
  a.ah_attr.port_num = static_cast<uint8_t>(port.port);
  a.ah_attr.dlid = remote.lid;
  if (port.ethernet || remote.lid == 0) {
    // RoCE (and routed InfiniBand) is addressed by GID. The hop limit must allow the routers
    // of a RoCE v2 fabric (a hop limit of 1 stops at the first).
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(port.gid_index);
    a.ah_attr.grh.hop_limit = static_cast<uint8_t>(std::min(hop_limit, 255));
  }
  if (int rc = lib().modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    fail(ErrorCode::SYSTEM, peer_, std::string("ibv_modify_qp(RTR): ") + std::strerror(rc));

  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn_;
  a.timeout = 14;    // 4.096 us * 2^14 = 67 ms per try
  a.retry_cnt = 7;
  a.rnr_retry = 7;   // infinite: never expected (credits), never fatal
  a.max_rd_atomic = initiator_depth(dev_->max_qp_init_rd_atom, remote.rd_atomic);  // <= its max_dest_rd_atomic
  if (int rc = lib().modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                            IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    fail(ErrorCode::SYSTEM, peer_, std::string("ibv_modify_qp(RTS): ") + std::strerror(rc));
  remote_ring_ = theirs.ring_addr;
  remote_rkey_ = theirs.ring_rkey;
  if (rma_) rma_->connected(peer_, qp_);
}

void VerbsChannel::shutdown() {
  // Flushes our posted work; the peer learns of the abort through its monitor socket.
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  (void)lib().modify_qp(qp_, &a, IBV_QP_STATE);
}

// WRITE WITH IMMEDIATE lands where the writer says: the receive request needs no buffer.
void VerbsChannel::post_recv() {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.num_sge = 0;
  if (int rc = ibv_post_recv(qp_, &wr, &bad)) fail(ErrorCode::SYSTEM, peer_, std::string("ibv_post_recv: ") + std::strerror(rc));
}

void VerbsChannel::post_write(const char* local, uint32_t len, uint64_t remote, uint32_t imm, uint64_t wr_id) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(local), len, staging_.lkey()};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.imm_data = htonl(imm);  // __be32: the immediate travels in network byte order
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = remote_rkey_;
  if (int rc = ibv_post_send(qp_, &wr, &bad)) lost(std::string("ibv_post_send: ") + std::strerror(rc));
  sq_busy_++;
}

void VerbsChannel::on_completion(const ibv_wc& wc) {
  // A window's RDMA WRITE / READ (its id says so even in a failed completion, whose opcode is
  // undefined): the window learns of it first; a failure has broken the queue pair for us too.
  if (is_rma_wr(wc.wr_id)) {
    if (rma_) rma_->completed(peer_, wc);
    if (wc.status != IBV_WC_SUCCESS) lost(std::string("RDMA WRITE / READ of a window: ") + lib().wc_status_str(wc.status));
    return;
  }
  if (wc.status != IBV_WC_SUCCESS) lost(std::string("work completion ") + lib().wc_status_str(wc.status));
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    Imm imm;
    if (!(wc.wc_flags & IBV_WC_WITH_IMM) || !decode_imm(ntohl(wc.imm_data), slot_bytes_, &imm))
      fail(ErrorCode::MISMATCH, peer_, "corrupt verbs message from rank " + std::to_string(peer_));
    if (!window_.restore(imm.credits))
      fail(ErrorCode::MISMATCH, peer_, "rank " + std::to_string(peer_) + " returned more credits than it was given");
    if (imm.kind == Kind::DATA) {
      if (arrived_.size() >= slots_)
        fail(ErrorCode::MISMATCH, peer_, "rank " + std::to_string(peer_) + " wrote more slots than its credits");
      arrived_.push_back(imm.bytes);
    }
    post_recv();
    return;
  }
  sq_busy_--;  // a write of ours completed (sq_sig_all), in posting order
  if (wc.wr_id == WR_DATA) sent_done_++;
}

bool VerbsChannel::poll_cq() {
  ibv_wc wc[16];
  bool any = !stash_.empty();
  if (any) {
    std::vector<ibv_wc> stashed;
    stashed.swap(stash_);
    for (const ibv_wc& c : stashed) on_completion(c);
  }
  for (;;) {
    const int n = ibv_poll_cq(cq_, 16, wc);
    if (n < 0) lost("ibv_poll_cq failed");
    for (int i = 0; i < n; i++) on_completion(wc[i]);
    any |= n > 0;
    if (n < 16) return any;
  }
}

bool VerbsChannel::ready(const Transfer&) const {
  ibv_cq* cq;
  void* ctx;
  bool fired = false;
  while (lib().get_cq_event(events_, &cq, &ctx) == 0) {  // non-blocking: EAGAIN ends it
    fired = true;
    if (++unacked_events_ >= 64) {  // acknowledging takes a mutex: batch it
      lib().ack_cq_events(cq_, unacked_events_);
      unacked_events_ = 0;
    }
  }
  if (fired || !armed_) {
    if (ibv_req_notify_cq(cq_, 0)) return true;  // cannot sleep on it: let progress() look
    armed_ = true;
  }
  ibv_wc wc[16];
  const int n = ibv_poll_cq(cq_, 16, wc);
  if (n < 0) return true;  // progress() polls again and reports the failure
  stash_.insert(stash_.end(), wc, wc + n);
  return !stash_.empty();
}

void VerbsChannel::return_credits() {
  if (window_.needs_explicit_return() && sq_busy_ < depth_) {
    post_write(nullptr, 0, remote_ring_, encode_imm({Kind::CREDIT, window_.to_return(), 0}), WR_CREDIT);
  }
}

bool VerbsChannel::progress(Transfer& t) {
  bool moved = poll_cq();
  moved |= t.is_send ? send(t) : recv(t);
  return_credits();
  return moved;
}

// Header and payload are copied into staging slots, one slot per write; each DATA write takes
// a credit (a free slot in the peer's ring) and a staging slot whose last write completed.
bool VerbsChannel::send(Transfer& t) {
  bool moved = false;
  while (!t.complete() && sq_busy_ < depth_ && sent_ - sent_done_ < slots_ && window_.try_take()) {
    const uint64_t slot = sent_ % slots_;
    char* dst = staging_.base() + slot * slot_bytes_;
    const uint32_t n = fill_slot(t, dst, slot_bytes_);
    post_write(dst, n, remote_ring_ + slot * slot_bytes_, encode_imm({Kind::DATA, window_.to_return(), n}), WR_DATA);
    sent_++;
    moved = true;
  }
  return moved;
}

// The header is checked before a payload byte is accepted into the buffer (accept_header).
bool VerbsChannel::recv(Transfer& t) {
  bool moved = false;
  while (!t.complete() && !arrived_.empty()) {
    const char* slot = ring_.base() + (read_slot_ % slots_) * slot_bytes_;
    read_off_ += take_from_slot(t, slot + read_off_, arrived_.front() - read_off_, peer_);
    moved = true;
    if (read_off_ == arrived_.front()) {  // the slot is empty: it goes back to the writer
      arrived_.pop_front();
      read_slot_++;
      read_off_ = 0;
      if (!window_.processed())
        fail(ErrorCode::MISMATCH, peer_, "rank " + std::to_string(peer_) + " wrote more slots than its credits");
    }
  }
  return moved;
}

// ---- the net ----------------------------------------------------------------------------------
// One protection domain on the chosen port and one unconnected queue pair per peer and stream,
// created at open so that address() can publish them all in one record; connect() brings the
// pair for (peer, stream) to RTS from the peer's record and hands it to the engine.
class VerbsNet final : public Net {
 public:
  // rma: windows over RDMA WRITE / READ on the p2p queue pairs (COMM_WINDOW_RMA=1).
  VerbsNet(int rank, int size, const PortInfo& port, int hop_limit, bool rma)
      : rank_(rank), size_(size), port_(port), hop_limit_(hop_limit), dev_(std::make_shared<Device>(port.device)) {
    if (rma) rma_ = std::make_shared<VerbsRmaHub>(dev_, size);
    channels_.resize(static_cast<size_t>(size) * kStreams);
    for (int p = 0; p < size; p++)
      for (uint32_t s = 0; s < kStreams && p != rank; s++)
        channels_[p * kStreams + s] = std::make_unique<VerbsChannel>(
            dev_, p, kSlots, kSlotBytes, s == static_cast<uint32_t>(Stream::P2P) ? rma_ : nullptr);
  }
  // Windows' registrations go with the net; the channels the engine holds keep the device.
  ~VerbsNet() override {
    if (rma_) rma_->release();
  }

  std::unique_ptr<RmaWindow> rma_window(const RmaMemory& mem) override {
    return rma_ ? open_verbs_rma_window(rma_, mem, rank_) : nullptr;
  }

  NetCaps caps() const override { return {}; }  // host memory, any size (the stream is sliced)

  std::string address() const override {
    Address a;
    a.port = static_cast<uint8_t>(port_.port);
    a.mtu = port_.mtu;
    a.lid = port_.lid;
    a.gid_index = static_cast<uint8_t>(port_.gid_index);
    a.rd_atomic = responder_resources(dev_->max_qp_rd_atom);
    std::memcpy(a.gid, port_.gid, 16);
    a.slots = kSlots;
    a.slot_bytes = kSlotBytes;
    a.streams = kStreams;
    a.entries.resize(channels_.size());
    for (size_t i = 0; i < channels_.size(); i++)
      if (channels_[i]) a.entries[i] = channels_[i]->entry();
    return encode_address(a);
  }

  // Verbs loops back through the adapter between processes of one host: same_host changes nothing.
  std::unique_ptr<Channel> connect(int peer, Stream stream, const std::string& remote, bool) override {
    Address theirs;
    std::string why;
    if (!decode_address(remote, size_, kStreams, &theirs, &why))
      fail(ErrorCode::MISMATCH, peer, "bad verbs address record from rank " + std::to_string(peer) + ": " + why);
    if (theirs.slots != kSlots || theirs.slot_bytes != kSlotBytes)
      fail(ErrorCode::MISMATCH, peer, "rank " + std::to_string(peer) + " uses another verbs ring geometry: mixed versions");
    const uint32_t s = static_cast<uint32_t>(stream);
    std::unique_ptr<VerbsChannel>& ch = channels_.at(static_cast<size_t>(peer) * kStreams + s);
    if (!ch) fail(ErrorCode::SYSTEM, peer, "verbs stream to rank " + std::to_string(peer) + " connected twice");
    ch->connect(port_, theirs, theirs.entries[static_cast<size_t>(rank_) * kStreams + s], hop_limit_);
    return std::move(ch);
  }

  std::string describe() const override {
    std::string out;
    for (const std::string& line : describe_ports()) out += line + "\n";
    return out;
  }

 private:
  static constexpr uint32_t kStreams = 2;  // Stream::COLL, Stream::P2P
  // 16 slots of 128 KiB per direction and stream: a ring chunk (COMM_CHUNK_BYTES, 512 KiB)
  // is four writes, and 16 keep a 100 Gb/s link busy over a few microseconds of latency.
  static constexpr uint32_t kSlots = 16, kSlotBytes = 128 << 10;
  int rank_, size_;
  PortInfo port_;
  int hop_limit_;
  std::shared_ptr<Device> dev_;
  std::shared_ptr<VerbsRmaHub> rma_;  // null without COMM_WINDOW_RMA
  std::vector<std::unique_ptr<VerbsChannel>> channels_;  // [peer * kStreams + stream]
};

namespace {
int option(const NetOptions& opts, const char* key, int fallback) {
  auto it = opts.find(key);
  return it == opts.end() || it->second.empty() ? fallback : std::stoi(it->second);
}

std::string option(const NetOptions& opts, const char* key) {
  auto it = opts.find(key);
  return it == opts.end() ? std::string() : it->second;
}
}  // namespace

}  // namespace comm::verbs

namespace comm {

// Options: "device" (name or name:port, empty: the first active port), "gid_index" (-1:
// choose), "hop_limit" (RoCE v2 / routed InfiniBand), "rma" ("1": windows over RDMA WRITE / READ).
std::string verbs_unavailable(const NetOptions& opts) {
  try {
    verbs::find_port(verbs::option(opts, "device"), verbs::option(opts, "gid_index", -1));
  } catch (const verbs::Unavailable& e) {
    return e.what();
  }
  return "";
}

std::unique_ptr<Net> open_verbs(int rank, int size, const NetOptions& opts) {
  try {
    const verbs::PortInfo port = verbs::find_port(verbs::option(opts, "device"), verbs::option(opts, "gid_index", -1));
    return std::make_unique<verbs::VerbsNet>(rank, size, port, verbs::option(opts, "hop_limit", 64),
                                             verbs::option(opts, "rma") == "1");
  } catch (const verbs::Unavailable& e) {
    fail(ErrorCode::SYSTEM, -1, std::string("verbs: ") + e.what());
  }
}

}  // namespace comm
