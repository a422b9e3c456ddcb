#include "core/engine.h"

#include <algorithm>
#include <cstring>

#include <unistd.h>

#include <sched.h>

#include "algorithms/algorithms.h"
#include "channels/tcp/tcp.h"

namespace comm {

void Op::finish(std::optional<CommError> error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void Op::rethrow() const {
  if (error_) throw *error_;
}

// Waits in slices of kSignalSlice so a signal (Ctrl-C) interrupts the wait.
void Op::wait(double timeout_s) {
  if (engine && !test()) return engine->wait(*this, timeout_s);
  if (!test()) {
    const auto end = timeout_s < 0 ? Clock::time_point::max()
                                   : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(timeout_s));
    auto done = [&] { return done_.load(std::memory_order_acquire); };
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_until(lock, std::min(end, Clock::now() + kSignalSlice), done)) {
      if (Clock::now() >= end)
        fail(ErrorCode::TIMEOUT, -1, "not completed within " + std::to_string(timeout_s) + " s");
      lock.unlock();  // the check may wait for Python's lock: never while holding ours
      check_signals();
      lock.lock();
    }
  }
  rethrow();
}

Engine::Engine(int rank, int size, std::vector<int> local_ranks, Options opt)
    : comm_(rank, size, std::move(opt)) {
  if (local_ranks.size() > 1) comm_.shm = std::make_unique<ShmDomain>(rank, std::move(local_ranks));
  comm_.set_local_ranks_known();
}

Engine::~Engine() { close(); }

int Engine::shm_create() { return comm_.shm->create(); }
void Engine::shm_attach(int rank, int pid, int fd) { comm_.shm->attach(rank, pid, fd); }

bool Engine::cma_probe() {
  if (!comm_.shm) return false;
  for (int i = 0; i < comm_.shm->local_size(); i++)
    if (i != comm_.shm->me() && !comm_.shm->probe_cma(i)) return false;
  return true;
}

void Engine::set_cma(bool everywhere) { comm_.cma = everywhere && comm_.shm; }

void Engine::set_hosts(const std::vector<int>& host_of) {
  if (host_of.size() != static_cast<size_t>(comm_.size))
    fail(ErrorCode::INVALID_ARGUMENT, -1, "set_hosts: one host per rank expected");
  comm_.topo = Topology(host_of, comm_.rank);
}

void Engine::add_peer(int peer, int monitor_fd, std::vector<int> coll_fds, int p2p_fd) {
  if (peer < 0 || peer >= comm_.size || peer == comm_.rank)
    fail(ErrorCode::INVALID_ARGUMENT, peer, "add_peer: no such peer " + std::to_string(peer));
  std::unique_ptr<Channel> coll, p2p;
  if (coll_fds.empty()) {
    if (!comm_.shm) fail(ErrorCode::INVALID_ARGUMENT, peer, "add_peer: no shared memory for a local peer");
    coll = std::make_unique<ShmChannel>(*comm_.shm, peer, Stream::COLL);
    p2p = std::make_unique<ShmChannel>(*comm_.shm, peer, Stream::P2P);
  } else {
    coll = std::make_unique<TcpChannel>(peer, std::move(coll_fds));
    p2p = std::make_unique<TcpChannel>(peer, std::vector<int>{p2p_fd});
  }
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (released_) {
    if (monitor_fd >= 0) ::close(monitor_fd);
    fail(ErrorCode::CLOSED, peer, "the communicator is closed");
  }
  comm_.register_peer(peer, monitor_fd, std::move(coll), std::move(p2p));
  if (p2p_) p2p_->add_peer(peer);
}

std::string Engine::open_net(const std::string& name, const NetOptions& opts) {
  comm_.net = comm::open_net(name, comm_.rank, comm_.size, opts);
  if (!comm_.net->caps().host_memory)  // the algorithms stage and reduce in host memory
    fail(ErrorCode::SYSTEM, -1, "net " + name + " cannot move host memory, which the engine needs");
  return comm_.net->address();
}

void Engine::add_net_peer(int peer, int monitor_fd, const std::string& address, bool same_host) {
  if (!comm_.net) fail(ErrorCode::SYSTEM, peer, "add_net_peer before open_net");
  auto coll = comm_.net->connect(peer, Stream::COLL, address, same_host);
  auto p2p = comm_.net->connect(peer, Stream::P2P, address, same_host);
  std::lock_guard<std::mutex> lock(peers_mu_);
  comm_.register_peer(peer, monitor_fd, std::move(coll), std::move(p2p));
  if (p2p_) p2p_->add_peer(peer);
}

void Engine::start(bool every_peer) {
  for (int r = 0; r < comm_.size; r++)
    if (every_peer && r != comm_.rank && !comm_.peers[r].coll)
      fail(ErrorCode::SYSTEM, r, "no connection to rank " + std::to_string(r));
  std::lock_guard<std::mutex> lock(peers_mu_);
  p2p_ = std::make_unique<P2P>(comm_);
  comm_.watch_start();
}

std::shared_ptr<Op> Engine::post(OpArgs args, bool blocking) {
  // A send / recv to a peer not connected yet connects it first (never under mu_: the
  // connection is registered through add_peer by whichever thread completes it).
  if (is_p2p(args.kind) && args.peer >= 0 && args.peer < comm_.size && args.peer != comm_.rank &&
      !comm_.peers[args.peer].coll && comm_.connector && !forked_.load(std::memory_order_relaxed))
    comm_.reach(args.peer);
  std::unique_lock<std::mutex> lock = admit(args);
  if (is_p2p(args.kind)) {
    // Never behind the collective queue: a posted irecv must not hold up anything.
    lock.unlock();
    return p2p_->post(std::move(args), blocking);
  }
  if (blocking && queue_.empty() && !busy_) {
    busy_ = true;
    lock.unlock();
    Op op(std::move(args));
    execute(op);
    lock.lock();
    busy_ = false;
    const bool queued = !queue_.empty();
    lock.unlock();
    idle_cv_.notify_all();        // close() may be waiting
    if (queued) cv_.notify_all();  // the progress thread may hold queued work
    op.rethrow();
    return nullptr;
  }
  auto op = std::make_shared<Op>(std::move(args));
  enqueue(op, blocking, lock);
  return op;
}

std::shared_ptr<Window> Engine::window(uintptr_t base, uint64_t size, uint32_t signals) {
  uint32_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
    if (!p2p_) fail(ErrorCode::INVALID_ARGUMENT, -1, "the engine is not started");
    id = ++windows_;
  }
  auto reach = [this](int peer) {  // a window's peer connected on first use, as a send's
    if (comm_.connector && !forked_.load(std::memory_order_relaxed) && !comm_.peers[peer].coll) comm_.reach(peer);
  };
  return std::make_shared<Window>(comm_, *p2p_, reach, id, base, size, signals);
}

void Engine::repost(const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> lock = admit(op->args);
  op->rearm();
  enqueue(op, false, lock);
}

std::unique_lock<std::mutex> Engine::admit(const OpArgs& args) {
  if (forked_.load(std::memory_order_relaxed))
    fail(ErrorCode::CLOSED, -1, "the communicator belongs to the process that forked this one");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
  if (!p2p_) fail(ErrorCode::INVALID_ARGUMENT, -1, "the engine is not started");
  validate(args, comm_.rank, comm_.size);  // before it is queued: a refused op leaves no trace
  return lock;
}

void Engine::enqueue(const std::shared_ptr<Op>& op, bool blocking, std::unique_lock<std::mutex>& lock) {
  op->engine = this;
  // A blocking post is waited for at once, and so, usually, is a small async one: the
  // progress thread leaves them to their waiter for kGrace after it first sees them (it
  // stamps `due` then, saving the post a clock read). A large one starts at once.
  const bool lazy = blocking || std::max(op->args.send_bytes, op->args.recv_bytes) <= kLazyMaxBytes;
  op->due = lazy ? kUnseen : kEager;
  posts_++;
  queue_.push_back(op);
  if (!thread_.joinable()) thread_ = std::thread([this] { progress_loop(); });
  const bool notify = !lazy || !armed_;
  lock.unlock();
  if (notify) cv_.notify_all();
}

void Engine::run_front(std::unique_lock<std::mutex>& lock, Deadline* deadline) {
  auto op = std::move(queue_.front());
  queue_.pop_front();
  busy_ = true;
  lock.unlock();
  const auto began = execute(*op, deadline);
  lock.lock();
  busy_ = false;
  // An op that waited past its due (its waiter came late, or never): the program overlaps
  // work with its operations, so the progress thread looks often again.
  if (op->due != kEager && op->due <= began) slice_ = kGrace;
  idle_cv_.notify_all();  // waiters of this op and of the next; close()
  if (!queue_.empty() && queue_.front()->due <= Clock::now()) cv_.notify_all();
}

void Engine::wait(Op& op, double timeout_s) {
  // The deadline is fixed by the first clock read: execute()'s when this thread runs the op
  // at once (the usual case, which thereby reads the clock once), else before sleeping.
  Deadline deadline{timeout_s};
  // Once close() began, only the progress thread ends queued ops (with CLOSED).
  auto claimable = [&] { return !busy_ && !queue_.empty() && !closed_; };
  auto runnable = [&] { return op.test() || claimable(); };
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (op.test()) break;
    if (claimable()) {
      // Not done, nothing running: op is still queued. Run the queue up to it, in order,
      // bounded by this wait's timeout as well as the communicator's.
      run_front(lock, &deadline);
      continue;
    }
    // Another thread runs an op (the progress thread, or close()). It usually ends soon:
    // yield the core for a while (a futex wake-up costs tens of microseconds on a busy
    // machine), then sleep in slices that notice the timeout and signals.
    const auto end = deadline.at(Clock::now());
    lock.unlock();
    const auto yield_until = Clock::now() + kYieldFor;
    while (!op.test() && busy_.load(std::memory_order_acquire) && Clock::now() < yield_until)
      sched_yield();
    lock.lock();
    while (!idle_cv_.wait_until(lock, std::min(end, Clock::now() + kSignalSlice), runnable)) {
      if (Clock::now() >= end)
        fail(ErrorCode::TIMEOUT, -1, "not completed within " + std::to_string(timeout_s) + " s");
      lock.unlock();  // the check may wait for Python's lock: never while holding ours
      check_signals();
      lock.lock();
    }
  }
  lock.unlock();
  op.rethrow();
}

void Engine::progress_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t posts_seen = posts_;
  auto quiet_since = Clock::now();
  while (!stopping_) {
    const auto now = Clock::now();
    if (posts_ != posts_seen) {  // ops were posted since the last look: stay armed
      posts_seen = posts_;
      quiet_since = now;
      armed_ = true;
    }
    if (!busy_ && !queue_.empty()) {
      Op& front = *queue_.front();
      if (front.due == kUnseen) front.due = now + kGrace;
      if (front.due <= now) {
        run_front(lock, nullptr);
        continue;
      }
      // Its waiter usually runs it first: look again when it is due, or a slice from now.
      // A copy: wait_until reads its time after waking, when the waiter may have run and
      // freed `front` (std::max would hand it a reference into the op).
      const Clock::time_point until = std::max(front.due, now + slice_);
      cv_.wait_until(lock, until);
    } else if (armed_ && now - quiet_since < kArmedFor) {
      cv_.wait_until(lock, now + slice_);  // a small op may be queued meanwhile without a notify
    } else {
      armed_ = false;
      slice_ = kGrace;
      cv_.wait(lock);
      continue;
    }
    // Nothing was left for this thread: the waiters keep up, so look less often (each look
    // on a machine with as many busy ranks as cores takes a core from one of them).
    slice_ = std::min(2 * slice_, std::chrono::duration_cast<Clock::duration>(kSliceMax));
  }
  for (auto& op : queue_) op->finish(CommError(ErrorCode::CLOSED, -1, "the communicator was closed"));
  queue_.clear();
  idle_cv_.notify_all();  // their waiters
}

OpArgs Engine::prepare(OpArgs args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
  validate(args, comm_.rank, comm_.size);  // once here; every start is validated again by post()
  if (comm_.size > 1 && !is_p2p(args.kind)) {
    const Algorithm algo = choose_algorithm(comm_, describe(args));
    args.algo = algo.run;
    args.algo_name = algo.name;
  }
  return args;
}

std::vector<RecentOp> Engine::recent_ops() const {
  std::lock_guard<std::mutex> lock(recent_mu_);
  std::vector<RecentOp> out;
  for (uint64_t i = recorded_ > kRecent ? recorded_ - kRecent : 0; i < recorded_; i++)
    out.push_back(recent_[i % kRecent]);
  return out;
}

// deadline: the waiting caller's, when it runs the op (the communicator's timeout bounds it too).
// Returns when it began.
Clock::time_point Engine::execute(Op& op, Deadline* deadline) {
  std::optional<CommError> error;
  const auto now = Clock::now();
  const auto end = deadline ? deadline->at(now) : Clock::time_point::max();
  const uint64_t seq = ++comm_.coll_seq;
  RecentOp* line;
  {
    std::lock_guard<std::mutex> lock(recent_mu_);
    line = &recent_[recorded_++ % kRecent];
    *line = RecentOp{seq, op.args.kind, op.args.dtype, op.args.count, op.args.root, "running",
                     std::chrono::duration<double>(now.time_since_epoch()).count()};
  }
  if (broken_) {
    error = *broken_;
  } else if (comm_.aborted.load()) {
    error = CommError(ErrorCode::ABORTED, -1, "the communicator was aborted");
  } else {
    try {
      comm_.deadline.at = std::min(end, now + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(comm_.opt.timeout_s)));
      run_collective(op.args, seq);
    } catch (const CommError& raw) {
      const CommError e = comm_.explain(raw);
      error = e;
      comm_.relay_failure(e);
      // The streams are now in an unknown state: the communicator cannot be trusted again.
      broken_ = CommError(e.code, e.peer, "an earlier operation failed: " + e.msg);
    }
  }
  {
    // Only this thread writes the recorder (execute runs one op at a time), so the line
    // is still this op's.
    std::lock_guard<std::mutex> lock(recent_mu_);
    line->state = error ? "failed" : "done";
  }
  op.finish(std::move(error));
  return now;
}

// A group of one: every collective is a local copy.
static void run_alone(const Coll& op) {
  const bool split = op.kind == OpKind::ALL_TO_ALL;
  const bool v = op.kind == OpKind::ALL_GATHER_V || op.kind == OpKind::REDUCE_SCATTER_V;
  const size_t bytes = split ? (*op.send_counts)[0] * op.elem
                       : v   ? (*op.recv_counts)[0] * op.elem
                             : op.count * op.elem;
  if (bytes && op.recv != op.send && op.kind != OpKind::BARRIER)
    std::memmove(op.recv, op.send, bytes);
}

Coll Engine::describe(const OpArgs& a) const {
  Coll op{};
  op.kind = a.kind;
  op.dtype = a.dtype;
  op.op = a.op;
  op.reduce = reduce_fn(a.dtype, a.op);
  op.send = reinterpret_cast<const char*>(a.send);
  op.recv = reinterpret_cast<char*>(a.recv);
  op.count = a.count;
  op.root = a.root;
  op.send_counts = &a.send_counts;
  op.recv_counts = &a.recv_counts;
  op.elem = itemsize(a.dtype);
  op.wire = a.wire;
  op.wire_block = a.wire_block;
  if (op.kind == OpKind::BROADCAST) op.send = op.recv;
  if (op.kind == OpKind::ALL_TO_ALL) op.count = 0;  // per-peer counts differ; lengths are checked
  // The headers of a v-collective carry a fingerprint of its counts: ranks that disagree on
  // any block's size fail on the first header they compare (vcoll.cc names the counts).
  if (op.kind == OpKind::ALL_GATHER_V || op.kind == OpKind::REDUCE_SCATTER_V)
    op.count = counts_fingerprint(a.recv_counts);
  return op;
}

void Engine::run_collective(const OpArgs& a, uint64_t seq) {
  const int n = comm_.size;
  Coll op = describe(a);
  op.seq = seq;
  // Elements each rank contributes to a reduction (its whole input), and of its result.
  size_t in_count = op.kind == OpKind::REDUCE_SCATTER ? n * op.count : op.count;
  size_t out_count = op.count;
  if (op.kind == OpKind::REDUCE_SCATTER_V) {
    in_count = 0;
    for (uint64_t k : a.recv_counts) in_count += k;
    out_count = a.count;
  }
  const bool reduces = op.kind == OpKind::ALL_REDUCE || op.kind == OpKind::REDUCE_SCATTER ||
                       op.kind == OpKind::REDUCE || op.kind == OpKind::REDUCE_SCATTER_V;
  if (reduces && a.op == ReduceOp::PREMUL_SUM) {
    // Each rank's factor may differ, so scale the local input before anything is sent.
    char* scaled = comm_.scratch(3, in_count * op.elem);
    scale_fn(a.dtype)(scaled, op.send, in_count, a.scale);
    op.send = scaled;
  }
  if (n == 1) {
    run_alone(op);
    last_algorithm_ = "local";
  } else if (a.wire != Wire::EXACT) {  // compressed: one algorithm, whatever the size
    last_algorithm_ = compressed_collective(comm_, op);
  } else {
    // prepared: chosen once (the choice does not depend on pointers)
    const Algorithm algo = a.algo ? Algorithm{a.algo_name, a.algo} : choose_algorithm(comm_, op);
    last_algorithm_ = algo.name;
    comm_.ran = nullptr;
    algo.run(comm_, op);
    if (comm_.ran) last_algorithm_ = comm_.ran;   // it chose among others itself (local_all_reduce)
  }
  const bool has_result = op.kind != OpKind::REDUCE || comm_.rank == op.root;
  if (reduces && a.op == ReduceOp::AVG && has_result)
    scale_fn(a.dtype)(op.recv, op.recv, out_count, 1.0 / n);
}

void Engine::abort() {
  if (forked_.load()) return;  // shutting the sockets down would cut the parent's connections
  comm_.abort();
  if (p2p_) p2p_->wake();
}

void Engine::revoke() {
  if (forked_.load()) return;
  comm_.abort('R');
  if (p2p_) p2p_->wake();
}

void Engine::close() {
  if (forked_.load()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    // An operation running on a caller's thread still uses the connections.
    idle_cv_.wait(lock, [&] { return !busy_; });
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (p2p_) p2p_->stop();  // pending sends / receives fail with CLOSED
  // A net's channels close first: closing flushes what they sent, so it has reached every
  // peer before the goodbye tells them that nothing more will come (flushed_before_goodbye).
  if (comm_.net) comm_.close_channels();
  if (!comm_.aborted.load()) comm_.say_goodbye();
  // p2p_ lives on (stopped: it answers CLOSED) so a racing post never sees it freed.
  std::lock_guard<std::mutex> lock(peers_mu_);
  released_ = true;
  comm_.release();
}

void Engine::forget_after_fork() {
  forked_.store(true);
  comm_.forget();
}

}  // namespace comm
