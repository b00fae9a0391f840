import com.sun.management.HotSpotDiagnosticMXBean;
import java.lang.management.GarbageCollectorMXBean;
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CyclicBarrier;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicLongArray;
import java.util.Collections;
import org.memquota.MemQuota;
import org.memquota.RetryOOM;

/** The JVM tests' workloads, run under libmemquota.so as preload and agent. */
public class JvmWorkload {
    static final int CHUNK = 64 << 10; // 1 MiB arrays would be humongous in G1

    public static void main(String[] args) throws Exception {
        switch (args[0]) {
            case "shrink":
                shrink(Integer.parseInt(args[1]), Integer.parseInt(args[2]),
                        args.length > 3 ? Integer.parseInt(args[3]) : 0);
                break;
            case "refuse": refuse(Integer.parseInt(args[1]), Integer.parseInt(args[2])); break;
            case "mixed": mixed(Integer.parseInt(args[1]), Integer.parseInt(args[2])); break;
            case "work": work(Integer.parseInt(args[1]), Integer.parseInt(args[2])); break;
            case "scopes": scopes(); break;
            case "retry": retry(Integer.parseInt(args[1])); break;
            case "split": split(Integer.parseInt(args[1])); break;
            case "stats": System.out.println("stats " + MemQuota.statsJson()); break;
            case "burst":
                burst(Integer.parseInt(args[1]), Integer.parseInt(args[2]), Integer.parseInt(args[3]),
                        Integer.parseInt(args[4]));
                break;
            default: throw new IllegalArgumentException(args[0]);
        }
    }

    static String flag(String name) {
        HotSpotDiagnosticMXBean bean = ManagementFactory.getPlatformMXBean(HotSpotDiagnosticMXBean.class);
        return bean.getVMOption(name).getValue();
    }

    static String ratios() {
        return flag("MinHeapFreeRatio") + "/" + flag("MaxHeapFreeRatio");
    }

    static long mib(long b) {
        return b >> 20;
    }

    /** Allocates `mib` MiB of 64 KiB arrays, keeping them all. */
    static List<byte[]> fill(int mib) {
        List<byte[]> keep = new ArrayList<>();
        for (int i = 0; i < mib * 16; i++) {
            keep.add(new byte[CHUNK]);
        }
        return keep;
    }

    /**
     * (a) and (d): garbage grows the heap; then direct buffers need its room. With
     * `shortMib` > 0 the limit is then set, from the budget's own figures, so that the
     * buffers fit only once the heap gives back `shortMib` MiB: the precondition holds
     * by construction, whatever size the JVM chose to grow the heap to.
     */
    static void shrink(int garbageMib, int directMib, int shortMib) {
        String before = ratios();
        List<byte[]> garbage = fill(garbageMib);
        long grown = Runtime.getRuntime().totalMemory();
        System.out.println("garbage " + garbage.size() + " arrays, heap committed " + mib(grown) + " MiB");
        garbage = null;
        if (shortMib > 0) {
            MemQuota.flush();
            String s = MemQuota.statsJson();
            long counted = stat(s, "native_bytes") + stat(s, "heap_committed_bytes");
            MemQuota.setLimit(counted + ((long) (directMib - shortMib) << 20));
            System.out.println("budget " + MemQuota.statsJson());
        }
        List<ByteBuffer> direct = new ArrayList<>();
        for (int i = 0; i < directMib / 8; i++) {
            direct.add(ByteBuffer.allocateDirect(8 << 20));
        }
        long after = Runtime.getRuntime().totalMemory();
        System.out.println("direct " + direct.size() * 8 + " MiB ok");
        System.out.println("heap committed grown " + mib(grown) + " MiB, after " + mib(after) + " MiB");
        System.out.println("memquota gcs " + MemQuota.gcCount());
        System.out.println("ratios before " + before + " after " + ratios());
        System.out.println("stats " + MemQuota.statsJson());
    }

    /**
     * The gate under bursts, `rounds` times: `garbageMib` of garbage grows the heap;
     * the limit is set, from the budget's own figures, half a request above what is
     * counted, so that no request fits until a GC gives heap back, and then room for
     * only a few. Then `threads` threads, released together by a barrier, each ask
     * `Unsafe.allocateMemory` (the native under direct buffers and Spark's pages;
     * untouched, so not resident) for `requestMib`, and hold what they got until the
     * round's figures are printed. The agent's soft ratio must be 1 (`soft=1`): a
     * background GC before the burst would make the room early.
     *
     * Two threads take thread dumps meanwhile, each a safepoint: a thread that passed
     * the gate's check is held at its entry into the VM until the safepoint ends,
     * before its malloc is counted, as a GC's pause would hold it. On two cores the
     * window between the check and the malloc is otherwise a few microseconds.
     */
    static void burst(int threads, int requestMib, int garbageMib, int rounds) throws Exception {
        java.lang.reflect.Field field = sun.misc.Unsafe.class.getDeclaredField("theUnsafe");
        field.setAccessible(true);
        sun.misc.Unsafe unsafe = (sun.misc.Unsafe) field.get(null);
        long request = (long) requestMib << 20;
        long roomy = MemQuota.limit();
        for (int round = 0; round < rounds; round++) {
            MemQuota.setLimit(roomy);
            List<byte[]> garbage = fill(garbageMib);
            garbage.clear();
            MemQuota.flush();
            String s = MemQuota.statsJson();
            long limit = stat(s, "native_bytes") + stat(s, "heap_committed_bytes") + request / 2;
            MemQuota.setLimit(limit);
            AtomicBoolean done = new AtomicBoolean();
            List<Thread> stoppers = new ArrayList<>();
            for (int i = 0; i < 2; i++) {
                stoppers.add(started(() -> {
                    ThreadMXBean mx = ManagementFactory.getThreadMXBean();
                    while (!done.get()) {
                        mx.dumpAllThreads(true, true);
                    }
                }));
            }
            CyclicBarrier start = new CyclicBarrier(threads);
            AtomicLongArray got = new AtomicLongArray(threads);
            List<Thread> ts = new ArrayList<>();
            for (int t = 0; t < threads; t++) {
                int me = t;
                ts.add(started(() -> {
                    try {
                        start.await();
                        got.set(me, unsafe.allocateMemory(request));
                    } catch (OutOfMemoryError e) {
                        // refused: the gate's answer when there is no room
                    } catch (Exception e) {
                        throw new RuntimeException(e);
                    }
                }));
            }
            for (Thread th : ts) {
                th.join();
            }
            done.set(true);
            for (Thread th : stoppers) {
                th.join();
            }
            MemQuota.flush();
            int granted = 0;
            for (int t = 0; t < threads; t++) {
                granted += got.get(t) != 0 ? 1 : 0;
            }
            // Every granted request is still held, so native now counts them all.
            String after = MemQuota.statsJson();
            System.out.println("round " + round + " granted " + granted + " limit " + limit + " native "
                    + stat(after, "native_bytes") + " error_bound " + stat(after, "error_bound_bytes"));
            for (int t = 0; t < threads; t++) {
                if (got.get(t) != 0) {
                    unsafe.freeMemory(got.get(t));
                }
            }
        }
        System.out.println("stats " + MemQuota.statsJson());
    }

    static sun.misc.Unsafe theUnsafe() throws Exception {
        java.lang.reflect.Field field = sun.misc.Unsafe.class.getDeclaredField("theUnsafe");
        field.setAccessible(true);
        return (sun.misc.Unsafe) field.get(null);
    }

    /** Sets the limit `extra` bytes above what the budget counts now. */
    static long limitAbove(long extra) {
        MemQuota.flush();
        String s = MemQuota.statsJson();
        long limit = stat(s, "native_bytes") + stat(s, "heap_committed_bytes") + extra;
        MemQuota.setLimit(limit);
        return limit;
    }

    /**
     * Two tasks in MemQuota.withRetry, each holding a block of `blockMib` of Unsafe
     * memory and then asking for a second. The limit is set, from the budget's own
     * figures, 2.5 blocks above what is counted, and a barrier makes both hold their
     * first block before either asks for its second: neither second block fits (half
     * a block is left), every task is blocked, and the retry machine rolls the younger
     * back. Its request throws RetryOOM; its attempt frees its first block (finally)
     * and runs again once the older has freed both of its blocks. The heap must not move meanwhile
     * (-Xms equal to -Xmx): it is counted too.
     */
    static void retry(int blockMib) throws Exception {
        sun.misc.Unsafe unsafe = theUnsafe();
        long block = (long) blockMib << 20;
        try {
            MemQuota.retryEnd();
            System.out.println("unexpected: retryEnd outside a block");
        } catch (IllegalStateException e) {
            System.out.println("end outside a block: " + e.getMessage());
        }
        System.out.println("last refusal outside a block: " + MemQuota.lastRefusal());
        limitAbove(2 * block + block / 2);
        System.out.println("budget " + MemQuota.statsJson());
        CyclicBarrier held = new CyclicBarrier(2);
        int[] attempts = new int[2];
        int[] rolled = new int[2];
        String[] caught = new String[2];
        List<Integer> granted = Collections.synchronizedList(new ArrayList<>());
        List<Thread> ts = new ArrayList<>();
        for (int t = 0; t < 2; t++) {
            int me = t;
            ts.add(started(() -> {
                long scope = MemQuota.scopeBegin("retry-" + me, me, 0);
                String result = MemQuota.withRetry(scope, () -> {
                    attempts[me]++;
                    long a = unsafe.allocateMemory(block);
                    try {
                        if (attempts[me] == 1) {
                            await(held);
                        }
                        long b;
                        try {
                            b = unsafe.allocateMemory(block);
                        } catch (RetryOOM e) {
                            rolled[me]++;
                            caught[me] = e.getClass().getName() + " is an OutOfMemoryError: "
                                    + (e instanceof OutOfMemoryError) + ": " + e.getMessage();
                            throw e;
                        }
                        granted.add(me); // holding both: the other cannot have its second now
                        unsafe.freeMemory(b);
                        return "2 blocks";
                    } finally {
                        unsafe.freeMemory(a);
                    }
                });
                MemQuota.scopeEnd(scope);
                System.out.println("task " + me + " " + result + " attempts " + attempts[me] + " rolled back "
                        + rolled[me]);
            }));
        }
        for (Thread th : ts) {
            th.join();
        }
        for (String c : caught) {
            if (c != null) {
                System.out.println("caught " + c);
            }
        }
        System.out.println("second blocks granted in order " + granted);
        System.out.println("stats " + MemQuota.statsJson());
    }

    /**
     * One task in MemQuota.withSplitRetry over 64 rows of `rowMib` each: the limit is
     * set, from the budget's own figures, 40 rows above what is counted, so the whole
     * input never fits and no other task can free anything: the gate throws
     * SplitAndRetryOOM and the rows are processed in pieces, in order.
     */
    static void split(int rowMib) throws Exception {
        sun.misc.Unsafe unsafe = theUnsafe();
        long row = (long) rowMib << 20;
        limitAbove(40 * row);
        long scope = MemQuota.scopeBegin("splitter", 1, 0);
        List<int[]> pieces = MemQuota.withSplitRetry(scope, new int[] {0, 64},
                r -> List.of(new int[] {r[0], (r[0] + r[1]) / 2}, new int[] {(r[0] + r[1]) / 2, r[1]}),
                r -> {
                    long p = unsafe.allocateMemory((r[1] - r[0]) * row);
                    unsafe.freeMemory(p);
                    return r;
                });
        MemQuota.scopeEnd(scope);
        StringBuilder sb = new StringBuilder();
        for (int[] r : pieces) {
            sb.append(' ').append(r[0]).append("..").append(r[1]);
        }
        System.out.println("pieces" + sb);
        System.out.println("stats " + MemQuota.statsJson());
    }

    static void await(CyclicBarrier b) {
        try {
            b.await();
        } catch (Exception e) {
            throw new RuntimeException(e);
        }
    }

    static Thread started(Runnable body) {
        Thread th = new Thread(body);
        th.start();
        return th;
    }

    /** A number in the stats JSON. */
    static long stat(String json, String field) {
        String key = "\"" + field + "\":";
        int at = json.indexOf(key) + key.length();
        int end = at;
        while (end < json.length() && Character.isDigit(json.charAt(end))) {
            end++;
        }
        return Long.parseLong(json.substring(at, end));
    }

    /** (b): the live heap leaves no room; the refusal is an OutOfMemoryError. */
    static void refuse(int liveMib, int directMib) {
        List<byte[]> live = fill(liveMib);
        try {
            ByteBuffer b = ByteBuffer.allocateDirect(directMib << 20);
            System.out.println("unexpected: got " + b.capacity());
        } catch (OutOfMemoryError e) {
            String first = e.getMessage().split("\n")[0];
            System.out.println("refused: " + first);
        }
        System.out.println("live " + live.size() + " arrays still held");
        // The JVM goes on: more heap work and a small direct buffer after the refusal.
        live = null;
        fill(64);
        System.out.println("after refusal: direct " + ByteBuffer.allocateDirect(1 << 20).capacity());
    }

    /** (c): threads mix heap churn and direct buffers for a while. */
    static void mixed(int seconds, int threads) throws Exception {
        long end = System.nanoTime() + seconds * 1_000_000_000L;
        AtomicLong directOps = new AtomicLong();
        AtomicLong ooms = new AtomicLong();
        run(threads, () -> System.nanoTime() < end, directOps, ooms);
        System.out.println("mixed direct ops " + directOps.get() + " ooms " + ooms.get());
        System.out.println("memquota gcs " + gcCount() + " jvm collections " + jvmCollections());
        System.out.println("stats " + MemQuota.statsJson());
    }

    /** The benchmark: a fixed amount of the same work, timed. Runs with or without memquota. */
    static void work(int rounds, int threads) throws Exception {
        AtomicLong left = new AtomicLong((long) rounds * threads);
        AtomicLong directOps = new AtomicLong();
        AtomicLong ooms = new AtomicLong();
        long start = System.nanoTime();
        run(threads, () -> left.getAndDecrement() > 0, directOps, ooms);
        long ms = (System.nanoTime() - start) / 1_000_000;
        System.out.println("work ms " + ms + " jvm collections " + jvmCollections() + " memquota gcs " + gcCount()
                + " ooms " + ooms.get());
    }

    /** A task scope driven from Java: attach, direct buffers, reservations, the leak report. */
    static void scopes() throws Exception {
        long task = MemQuota.scopeBegin("task-7", 7, 0);
        MemQuota.scopeAttach(task);
        List<ByteBuffer> held = new ArrayList<>();
        for (int i = 0; i < 3; i++) {
            held.add(ByteBuffer.allocateDirect(8 << 20));
        }
        // A helper thread working for the task.
        Thread helper = new Thread(() -> {
            MemQuota.scopeAttach(task);
            held.add(ByteBuffer.allocateDirect(8 << 20));
            MemQuota.scopeDetach();
        });
        helper.start();
        helper.join();
        long granted = MemQuota.scopeReserve(task, 16 << 20, false);
        System.out.println("reserved " + (granted >> 20) + " MiB");
        try {
            MemQuota.scopeReserve(task, MemQuota.limit(), false);
            System.out.println("unexpected: the whole limit was reserved");
        } catch (OutOfMemoryError e) {
            System.out.println("reserve refused: " + e.getMessage().split("\n")[0]);
            System.out.println("report names the scope: " + e.getMessage().contains("task-7"));
        }
        MemQuota.scopeDetach();
        MemQuota.flush();
        String report = MemQuota.scopeEnd(task);
        System.out.println("end: " + report.split("\n")[0]);
        try {
            MemQuota.scopeEnd(task);
        } catch (IllegalArgumentException e) {
            System.out.println("second end: " + e.getMessage());
        }
        System.out.println("held " + held.size() + " buffers");
    }

    interface Going {
        boolean more();
    }

    /** Each thread: 4 MiB of 64 KiB arrays, a direct buffer of 1-8 MiB, old ones dropped. */
    static void run(int threads, Going going, AtomicLong directOps, AtomicLong ooms) throws Exception {
        List<Thread> ts = new ArrayList<>();
        for (int t = 0; t < threads; t++) {
            Thread th = new Thread(() -> {
                ThreadLocalRandom r = ThreadLocalRandom.current();
                List<byte[]> heap = new ArrayList<>();
                List<ByteBuffer> direct = new ArrayList<>();
                while (going.more()) {
                    for (int i = 0; i < 64; i++) {
                        heap.add(new byte[CHUNK]);
                    }
                    if (heap.size() > 512) {
                        heap.subList(0, 256).clear();
                    }
                    try {
                        direct.add(ByteBuffer.allocateDirect((1 + r.nextInt(8)) << 20));
                        directOps.incrementAndGet();
                    } catch (OutOfMemoryError e) {
                        ooms.incrementAndGet();
                    }
                    if (direct.size() > 6) {
                        direct.subList(0, 3).clear();
                    }
                }
            }, "worker-" + t);
            ts.add(th);
            th.start();
        }
        for (Thread th : ts) {
            th.join();
        }
    }

    static long jvmCollections() {
        long n = 0;
        for (GarbageCollectorMXBean gc : ManagementFactory.getGarbageCollectorMXBeans()) {
            n += gc.getCollectionCount();
        }
        return n;
    }

    /** memquota's GCs, or 0 when the JVM runs without it (the benchmark's baseline). */
    static long gcCount() {
        try {
            return MemQuota.gcCount();
        } catch (UnsatisfiedLinkError | NoClassDefFoundError e) {
            return 0;
        }
    }
}
