"""A PySpark job whose Tungsten pages are malloc'd, for running Spark under memquota.

Off-heap memory is on (spark.memory.offHeap.enabled), so every page Spark's memory
manager hands to the aggregation, the sort and the shuffle writer is one
Unsafe.allocateMemory call: one malloc of spark.buffer.pageSize bytes, which the
preload charges (and may refuse: keep pages above MEMQUOTA_REFUSE_MIN, 4 MiB by
default).

The job: spark.range(rows) grouped by id % groups (count, sum, min, max), and a global
sort of a permutation of the ids. Both results are checked against arithmetic. Prints
one line starting `memquota-spark-job:` and exits with
  0  OK: both results are right;
  1  WRONG RESULT;
  2  FAILED: Spark failed the job (a refused page: SparkOutOfMemoryError);
  3  JVM LOST: the JVM went away (a crash or a kill).

Run with the venv made by scripts/spark-venv.sh:

    target/spark-venv/bin/python ld_preload/tests/spark/job.py \
        --preload target/release/libmemquota.so --agent-options limit=4g,heap=committed

LD_PRELOAD is set in os.environ here, before the SparkSession starts the JVM: this
Python process is not preloaded, the JVM it launches is.
"""

import argparse
import math
import os
import sys
import time

PREFIX = "memquota-spark-job:"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=int(os.environ.get("JOB_ROWS", 2_000_000)))
    p.add_argument("--groups", type=int, default=1000)
    p.add_argument("--master", default="local[2]", help="local[2], or local-cluster[1,1,1024]")
    p.add_argument("--partitions", type=int, default=4, help="spark.sql.shuffle.partitions")
    p.add_argument("--offheap-size", default="512m", help="spark.memory.offHeap.size")
    p.add_argument("--page-size", default="64m", help="spark.buffer.pageSize (one malloc per page)")
    p.add_argument("--driver-memory", default="512m", help="spark.driver.memory (-Xmx of the driver)")
    p.add_argument(
        "--preload",
        default=os.environ.get("MEMQUOTA_SO"),
        help="libmemquota.so: LD_PRELOAD of the driver JVM (and of local-cluster executors)",
    )
    p.add_argument(
        "--agent-options",
        default=os.environ.get("MEMQUOTA_AGENT_OPTIONS"),
        help="with --preload: adds -agentpath:<preload>=<these options> to the driver "
        "and executor JVMs, e.g. limit=4g,heap=committed,stats_file=/tmp/s.prom",
    )
    p.add_argument("--java-options", default="", help="more driver and executor JVM options")
    p.add_argument(
        "--executor-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="spark.executorEnv.NAME=VALUE (repeatable)",
    )
    p.add_argument(
        "--executor-preload-only",
        action="store_true",
        help="give LD_PRELOAD to the executors (spark.executorEnv.LD_PRELOAD) and not to the driver",
    )
    return p.parse_args()


def java_options(args, preloaded):
    """The JVM options of a driver or executor; the agent only where the library is
    preloaded too (the agent refuses to load without the preload)."""
    opts = []
    if preloaded and args.agent_options is not None:
        opts.append(f"-agentpath:{args.preload}={args.agent_options}")
    if args.java_options:
        opts.append(args.java_options)
    return " ".join(opts)


def build_session(args):
    if args.preload and not os.path.exists(args.preload):
        sys.exit(f"{PREFIX} no such library: {args.preload}")
    # One machine: no need to look for a routable address (and no warning about it).
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if args.preload and not args.executor_preload_only:
        # Read by the JVM that SparkSession launches below, not by this process.
        os.environ["LD_PRELOAD"] = args.preload

    from pyspark.sql import SparkSession

    b = (
        SparkSession.builder.master(args.master)
        .appName("memquota-spark-job")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.memory.offHeap.enabled", "true")
        .config("spark.memory.offHeap.size", args.offheap_size)
        .config("spark.buffer.pageSize", args.page_size)
        .config("spark.sql.shuffle.partitions", str(args.partitions))
        .config("spark.sql.adaptive.enabled", "false")
        # A refused page fails the task; in local mode retrying it only repeats the
        # failure (and local mode does not retry by default anyway).
        .config("spark.task.maxFailures", "1")
    )
    driver_preloaded = bool(args.preload) and not args.executor_preload_only
    # In local mode the executor is the driver; local-cluster launches executor JVMs.
    executors_preloaded = bool(args.preload) and (args.executor_preload_only or args.master.startswith("local-cluster"))
    if executors_preloaded:
        b = b.config("spark.executorEnv.LD_PRELOAD", args.preload)
    for key, preloaded in [("spark.driver.extraJavaOptions", driver_preloaded), ("spark.executor.extraJavaOptions", executors_preloaded)]:
        opts = java_options(args, preloaded)
        if opts:
            b = b.config(key, opts)
    for kv in args.executor_env:
        name, _, value = kv.partition("=")
        b = b.config(f"spark.executorEnv.{name}", value)
    return b.getOrCreate()


def expected_groups(rows, groups):
    """{g: (count, sum, min, max)} of the ids 0..rows-1 with id % groups == g."""
    out = {}
    for g in range(min(groups, rows)):
        c = (rows - g + groups - 1) // groups
        out[g] = (c, g * c + groups * c * (c - 1) // 2, g, g + groups * (c - 1))
    return out


def check_groupby(spark, args):
    from pyspark.sql import functions as F

    df = spark.range(args.rows).withColumn("k", F.col("id") % args.groups)
    got = (
        df.groupBy("k")
        .agg(F.count("*").alias("n"), F.sum("id").alias("s"), F.min("id").alias("lo"), F.max("id").alias("hi"))
        .orderBy("k")
        .collect()
    )
    want = expected_groups(args.rows, args.groups)
    have = {r["k"]: (r["n"], r["s"], r["lo"], r["hi"]) for r in got}
    if have != want:
        bad = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))[:5]
        raise AssertionError(f"groupBy differs at {bad}: want {[want.get(k) for k in bad]}, got {[have.get(k) for k in bad]}")
    return len(got)


def check_sort(spark, args):
    """Sorts x = id * p % rows (a permutation of 0..rows-1, as p is coprime to rows)
    with a payload column, then proves the output is 0, 1, ..., rows-1 in order: in
    each output partition x - (row index in the partition) is one constant, and the
    constants chain up from 0 by the partition sizes. Everything stays in the JVM."""
    from pyspark.sql import functions as F

    p = 1_000_003
    while math.gcd(p, args.rows) != 1:
        p += 2
    df = spark.range(args.rows).select(
        (F.col("id") * p % args.rows).alias("x"),
        F.sha2(F.col("id").cast("string"), 256).alias("payload"),
    )
    ordered = df.orderBy("x").select(
        "x", "payload", F.spark_partition_id().alias("part"), F.monotonically_increasing_id().alias("mid")
    )
    # monotonically_increasing_id is partition << 33 | index within the partition.
    per_part = (
        ordered.select("part", (F.col("x") - (F.col("mid").bitwiseAND((1 << 33) - 1))).alias("off"), "payload")
        .groupBy("part")
        .agg(F.count("*").alias("n"), F.min("off").alias("lo"), F.max("off").alias("hi"), F.max(F.length("payload")).alias("w"))
        .collect()
    )
    next_start = 0
    for r in sorted(per_part, key=lambda r: r["lo"]):
        if r["lo"] != r["hi"] or r["lo"] != next_start or r["w"] != 64:
            raise AssertionError(f"sort output is not 0..{args.rows - 1} in order: partition {r.asDict()}, expected offset {next_start}")
        next_start += r["n"]
    if next_start != args.rows:
        raise AssertionError(f"sort output has {next_start} rows, want {args.rows}")
    return len(per_part)


def main():
    args = parse_args()
    t0 = time.monotonic()
    spark = build_session(args)
    from py4j.protocol import Py4JJavaError

    sc = spark.sparkContext
    if args.master.startswith("local-cluster"):
        # The standalone worker sends each executor's stdout and stderr to files here.
        work = os.path.join(sc._jvm.java.lang.System.getenv("SPARK_HOME") or "", "work", sc.applicationId)
        print(f"{PREFIX} executor logs in {work}", flush=True)
    try:
        groups = check_groupby(spark, args)
        parts = check_sort(spark, args)
    except AssertionError as e:
        print(f"{PREFIX} WRONG RESULT: {e}", flush=True)
        return 1
    except Py4JJavaError as e:  # Spark failed the job and said why.
        first = str(e).strip().splitlines()
        print(f"{PREFIX} FAILED: {type(e).__name__}: {first[0] if first else ''}", flush=True)
        causes = [line.strip() for line in str(e).splitlines() if "OutOfMemory" in line or "memquota" in line]
        for line in causes[:5]:
            print(f"{PREFIX}   {line}", flush=True)
        return 2
    except Exception as e:  # Most often the JVM died under us (a crash, a kill).
        print(f"{PREFIX} JVM LOST: {type(e).__name__}: {e}", flush=True)
        return 3
    finally:
        try:
            spark.stop()
        except Exception as e:
            print(f"{PREFIX} spark.stop() failed: {type(e).__name__}", flush=True)
    print(
        f"{PREFIX} OK rows={args.rows} groups={groups} sorted_partitions={parts} "
        f"master={args.master} seconds={time.monotonic() - t0:.1f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
