package org.memquota;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;
import java.util.function.Function;
import java.util.function.Supplier;

/**
 * The process's memquota budget, seen from Java.
 *
 * <p>Finds the libmemquota.so this process already runs under (the one given to
 * {@code LD_PRELOAD} and {@code -agentpath}) by its path in {@code /proc/self/maps},
 * or the path in the system property {@code memquota.library}, and binds its JNI
 * methods. Every method is static: there is one budget per process.
 *
 * <p>Task scopes are plain {@code long} handles, so that a task listener can begin a
 * scope when a task starts, attach the task's threads, and end it when the task ends.
 * Work inside {@link #withRetry} and {@link #withSplitRetry} completes under pressure:
 * an allocation that does not fit waits, and the youngest task gives way when all
 * are stuck.
 */
public final class MemQuota {
    /** The system property that names the library explicitly. */
    public static final String LIBRARY_PROPERTY = "memquota.library";

    private static final String FILE_NAME = "libmemquota.so";

    static {
        System.load(libraryPath());
    }

    private MemQuota() {}

    /** The budget's statistics as one JSON object (see docs/observability.md). */
    public static native String statsJson();

    /** The limit in bytes: native plus counted heap may not pass it. */
    public static native long limit();

    /**
     * Sets the limit in bytes.
     *
     * @throws IllegalArgumentException if {@code bytes <= 0}
     */
    public static void setLimit(long bytes) {
        if (bytes <= 0) {
            throw new IllegalArgumentException("memquota: the limit must be positive, got " + bytes);
        }
        setLimit0(bytes);
    }

    /** Moves the calling thread's not yet counted bytes to the process account. */
    public static native void flush();

    /** {@code System.gc()} calls memquota made to make room for native memory. */
    public static native long gcCount();

    private static native void setLimit0(long bytes);

    // ---- task scopes (docs/scopes.md) ----------------------------------------------

    /**
     * Begins a task scope. Allocations of threads attached to it are charged to it as
     * well as to the process.
     *
     * @param priority lower is spilled first by other scopes
     * @return the scope's handle
     * @throws IllegalStateException if too many scopes are alive
     */
    public static native long scopeBegin(String name, long id, int priority);

    /**
     * Ends a scope: what its threads still hold goes to the process account and its
     * reservations are released.
     *
     * @return the scope's report; it says "managed memory leak detected" if the scope
     *     still held memory
     * @throws IllegalArgumentException if the scope is not running
     */
    public static native String scopeEnd(long scope);

    /**
     * Attaches the calling thread to a scope, replacing any scope it was in.
     *
     * @throws IllegalArgumentException if the scope is not running
     */
    public static native void scopeAttach(long scope);

    /** Detaches the calling thread from its scope, if any. */
    public static native void scopeDetach();

    /**
     * Reserves {@code bytes} for a scope, spilling its consumers and waiting (bounded)
     * for its fair share if need be.
     *
     * @param partial grant what the fair share allows instead of all or nothing
     * @return the bytes granted
     * @throws OutOfMemoryError carrying memquota's report, if the reservation is refused
     * @throws RetryOOM in a retry block, when the thread is rolled back
     * @throws SplitAndRetryOOM in a retry block, when the thread must split its input
     * @throws IllegalArgumentException if the scope is not running
     * @throws IllegalStateException if called from a spill or reclaim callback
     */
    public static native long scopeReserve(long scope, long bytes, boolean partial);

    /** Gives back {@code bytes} a scope reserved. */
    public static native void scopeRelease(long scope, long bytes);

    // ---- retry blocks (docs/scopes.md, "Retry blocks") ---------------------------------

    /** Rollbacks one block goes through before {@link #withRetry} gives up. */
    public static final int MAX_RETRIES = 500;

    /** {@link #lastRefusal}: no rollback or split since the attempt began. */
    public static final int REFUSAL_NONE = 0;
    /** {@link #lastRefusal}: rolled back. */
    public static final int REFUSAL_ROLLBACK = 1;
    /** {@link #lastRefusal}: told to split. */
    public static final int REFUSAL_SPLIT = 2;
    /** {@link #lastRefusal}: the block's scope ended while the request waited. */
    public static final int REFUSAL_SCOPE_ENDED = 3;

    /**
     * Runs {@code attempt} on the calling thread attached to {@code scope}, in a retry
     * block. There, {@code Unsafe.allocateMemory} (direct buffers, Spark's off-heap
     * pages) of {@code refuse_min} or more, and {@link #scopeReserve}, wait for memory
     * to be freed instead of failing. When every task is blocked the youngest is
     * rolled back: its request throws {@link RetryOOM}, the attempt must free what it
     * holds (in {@code finally} blocks) and let it through, and the attempt runs again
     * once an older task has freed memory or finished.
     *
     * <p>Direct buffers are freed only when the GC collects them: an attempt that
     * rolls back should free its native memory explicitly ({@code Unsafe.freeMemory},
     * its pool's pages).
     *
     * @return what the attempt returned
     * @throws SplitAndRetryOOM when this task must split its input (see {@link
     *     #withSplitRetry})
     * @throws RetryOOM after {@link #MAX_RETRIES} rollbacks
     * @throws OutOfMemoryError a plain refusal, with the report: a wait ended by the
     *     watchdog (10 s)
     * @throws IllegalArgumentException if the scope is not running
     */
    public static <T> T withRetry(long scope, Supplier<T> attempt) {
        retryBegin(scope);
        try {
            return retrying(attempt);
        } finally {
            retryEnd();
        }
    }

    /**
     * {@link #withRetry} over pieces of {@code input}: when a piece's attempt throws
     * {@link SplitAndRetryOOM}, {@code split} cuts it into two or more pieces, in
     * order, and each is processed in turn.
     *
     * @return one result per piece processed, in input order
     * @throws SplitAndRetryOOM when {@code split} returns fewer than two pieces
     * @throws RetryOOM after {@link #MAX_RETRIES} rollbacks of one piece
     * @throws OutOfMemoryError a plain refusal, as in {@link #withRetry}
     * @throws IllegalArgumentException if the scope is not running
     */
    public static <I, T> List<T> withSplitRetry(
            long scope, I input, Function<I, List<I>> split, Function<I, T> f) {
        retryBegin(scope);
        try {
            List<I> todo = new ArrayList<>(); // a stack: the next piece last
            todo.add(input);
            List<T> done = new ArrayList<>();
            while (!todo.isEmpty()) {
                I piece = todo.remove(todo.size() - 1);
                try {
                    done.add(retrying(() -> f.apply(piece)));
                } catch (SplitAndRetryOOM e) {
                    List<I> pieces = split.apply(piece);
                    if (pieces == null || pieces.size() < 2) {
                        throw e;
                    }
                    for (int i = pieces.size() - 1; i >= 0; i--) {
                        todo.add(pieces.get(i));
                    }
                }
            }
            return done;
        } finally {
            retryEnd();
        }
    }

    /** Runs {@code attempt} again after each rollback, at most MAX_RETRIES times. */
    private static <T> T retrying(Supplier<T> attempt) {
        for (int rollbacks = 0; ; rollbacks++) {
            try {
                return attempt.get();
            } catch (RetryOOM e) {
                if (rollbacks >= MAX_RETRIES || !retryBlock()) {
                    throw e;
                }
            }
        }
    }

    /**
     * Begins a retry block on the calling thread (the primitive under {@link
     * #withRetry}, as {@code memquota_retry_begin} in C): attaches it to {@code scope}
     * until {@link #retryEnd}. Blocks nest.
     *
     * @throws IllegalArgumentException if the scope is not running
     * @throws IllegalStateException if blocks nest deeper than 16
     */
    public static native void retryBegin(long scope);

    /**
     * Ends the calling thread's innermost retry block: it is attached again to the
     * scope it was in when the block began.
     *
     * @throws IllegalStateException if the thread is in no retry block
     */
    public static native void retryEnd();

    /**
     * After a {@link RetryOOM}, once the attempt has freed what it held: waits until
     * the thread may run its attempt again (no older task blocked, room for what it
     * failed on).
     *
     * @return true: run the attempt again (at once if no rollback was pending); false:
     *     the thread was rolled back more than {@link #MAX_RETRIES} times in its
     *     outermost block, give up
     * @throws IllegalStateException if the thread is in no retry block, or if the
     *     block's scope ended (at once, also while the thread waits)
     */
    public static native boolean retryBlock();

    /**
     * How the calling thread's last refusal in its retry block went: {@link
     * #REFUSAL_ROLLBACK}, {@link #REFUSAL_SPLIT}, {@link #REFUSAL_SCOPE_ENDED} or {@link
     * #REFUSAL_NONE}; negative if the thread is in no retry block.
     */
    public static native int lastRefusal();

    /** Where the library is: the property, else the mapped libmemquota.so. */
    static String libraryPath() {
        String path = System.getProperty(LIBRARY_PROPERTY);
        if (path != null && !path.isEmpty()) {
            return path;
        }
        try {
            List<String> maps = Files.readAllLines(Paths.get("/proc/self/maps"));
            for (String line : maps) {
                int slash = line.indexOf('/');
                if (slash >= 0 && line.endsWith("/" + FILE_NAME)) {
                    return line.substring(slash);
                }
            }
        } catch (IOException e) {
            throw new UnsatisfiedLinkError("memquota: cannot read /proc/self/maps: " + e);
        }
        throw new UnsatisfiedLinkError(
                "memquota: " + FILE_NAME + " is not loaded in this process. Run the JVM under it: "
                        + "LD_PRELOAD=/path/" + FILE_NAME + " java -agentpath:/path/" + FILE_NAME
                        + "=limit=4g ..., or set -D" + LIBRARY_PROPERTY + "=/path/" + FILE_NAME);
    }
}
