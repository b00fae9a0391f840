package org.memquota;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.List;

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
     * @throws IllegalArgumentException if the scope is not running
     * @throws IllegalStateException if called from a spill or reclaim callback
     */
    public static native long scopeReserve(long scope, long bytes, boolean partial);

    /** Gives back {@code bytes} a scope reserved. */
    public static native void scopeRelease(long scope, long bytes);

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
